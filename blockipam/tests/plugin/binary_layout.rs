//! The built `blockipam` executable's layout: its 8 MiB call arena takes no room in the file.

use std::process::Command;

/// One row of `readelf --section-headers --wide`: index, name and size in bytes.
#[derive(Debug)]
struct Section {
    index: usize,
    name: String,
    size: u64,
}

fn readelf(args: &[&str]) -> String {
    let binary = env!("CARGO_BIN_EXE_blockipam");
    let output = Command::new("readelf")
        .args(args)
        .arg(binary)
        .output()
        .expect("run readelf (binutils) on the plugin executable");
    assert!(
        output.status.success(),
        "readelf {args:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).expect("readelf prints text")
}

/// The section table: rows look like `  [29] .data  PROGBITS  0000000001457000 1254000 805128 ...`.
fn sections() -> Vec<Section> {
    readelf(&["--section-headers", "--wide"])
        .lines()
        .filter_map(|line| {
            let (index, rest) = line.trim_start().strip_prefix('[')?.split_once(']')?;
            let index = index.trim().parse().ok()?;
            let fields: Vec<&str> = rest.split_whitespace().collect();
            // Name, type, address, offset, size.
            let size = u64::from_str_radix(fields.get(4)?, 16).ok()?;
            Some(Section {
                index,
                name: (*fields.first()?).to_owned(),
                size,
            })
        })
        .collect()
}

/// The arena's static sits in `.bss` (zero bytes, not stored in the file), not in `.data`: one
/// non-zero byte in its initial value would make the linker store all 8 MiB in every executable.
#[test]
fn the_call_arena_lives_in_bss_and_adds_nothing_to_the_file() {
    let sections = sections();
    assert!(
        sections.iter().any(|s| s.name == ".text"),
        "the section table was not read: {sections:?}"
    );
    // Symbol rows: `Num: Value Size Type Bind Vis Ndx Name`.
    let symbols = readelf(&["--syms", "--wide"]);
    let arena = symbols
        .lines()
        .find(|line| line.contains("CALL_ARENA"))
        .unwrap_or_else(|| panic!("no CALL_ARENA symbol in the plugin executable"));
    let fields: Vec<&str> = arena.split_whitespace().collect();
    let size = fields
        .get(2)
        .and_then(|size| match size.strip_prefix("0x") {
            Some(hex) => u64::from_str_radix(hex, 16).ok(),
            None => size.parse().ok(),
        })
        .unwrap_or_else(|| panic!("no size in the symbol row {arena:?}"));
    assert!(size >= 8 << 20, "the arena is {size} bytes: {arena:?}");
    let section_index: usize = fields
        .get(6)
        .and_then(|index| index.parse().ok())
        .unwrap_or_else(|| panic!("no section index in the symbol row {arena:?}"));
    let section = sections
        .iter()
        .find(|s| s.index == section_index)
        .unwrap_or_else(|| panic!("no section {section_index} in {sections:?}"));
    assert_eq!(
        section.name, ".bss",
        "CALL_ARENA is in {section:?}, so its {size} bytes are stored in the file"
    );
    let data: u64 = sections
        .iter()
        .filter(|s| s.name.starts_with(".data"))
        .map(|s| s.size)
        .sum();
    assert!(
        data < size,
        "the .data sections hold {data} bytes, as much as the arena's {size}: {sections:?}"
    );
}
