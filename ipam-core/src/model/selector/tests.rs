//! Selector tests: Calico's own parser tables (`libcalico-go/lib/selector/parser/parser_test.go`:
//! `selectorTests`, `badSelectors`, `canonicalisationTests`), error positions, and property tests
//! that the canonical form parses back to the same expression and evaluates the same.

use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;

use super::*;

fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

fn parse(text: &str) -> Selector {
    Selector::parse(text).unwrap_or_else(|e| panic!("{text:?} should parse: {e}"))
}

type Labels<'a> = &'a [&'a [(&'a str, &'a str)]];

/// Calico's `selectorTests`: each selector, label sets it matches and label sets it does not.
const CALICO_SELECTOR_TESTS: &[(&str, Labels, Labels)] = &[
    (
        r#"a == "b""#,
        &[&[("a", "b")], &[("a", "b"), ("c", "d")]],
        &[&[], &[("a", "c")], &[("c", "d")]],
    ),
    (
        r#"a == "b" && c == "d""#,
        &[&[("a", "b"), ("c", "d")]],
        &[
            &[],
            &[("a", "b"), ("c", "e")],
            &[("a", "c"), ("c", "d")],
            &[("c", "d")],
            &[("a", "b")],
        ],
    ),
    (
        r#"a == "b" || c == "d""#,
        &[&[("a", "b"), ("c", "d")], &[("a", "b")], &[("c", "d")]],
        &[&[], &[("a", "e"), ("c", "e")], &[("c", "e")], &[("a", "e")]],
    ),
    (
        r#"a in {"'", '"', "c"}"#,
        &[&[("a", "c")], &[("a", "\"")], &[("a", "'")]],
        &[&[], &[("a", "e")]],
    ),
    (
        r#"a not in {"'", '"', "c"}"#,
        &[&[], &[("a", "e")]],
        &[&[("a", "c")], &[("a", "\"")], &[("a", "'")]],
    ),
    (r#"a == 'a'"#, &[&[("a", "a")]], &[]),
    (r#"a == "a""#, &[&[("a", "a")]], &[]),
    (r#"a != "b""#, &[&[("a", "a")]], &[]),
    (r#"a != "a""#, &[&[]], &[]),
    (
        r#"a contains "a""#,
        &[&[("a", "a")], &[("a", "bab")], &[("a", "aaa"), ("b", "c")]],
        &[&[], &[("a", "b")], &[("b", "aaa")]],
    ),
    (
        r#"a starts with "a""#,
        &[&[("a", "a")], &[("a", "abb")], &[("a", "aaa"), ("b", "c")]],
        &[&[], &[("a", "b")], &[("a", "baa")], &[("b", "aaa")]],
    ),
    (
        r#"a ends with "a""#,
        &[&[("a", "a")], &[("a", "bba")], &[("a", "aaa"), ("b", "c")]],
        &[&[], &[("a", "b")], &[("a", "aab")], &[("b", "aaa")]],
    ),
    (r#"a in {"a"}"#, &[&[("a", "a")]], &[]),
    (r#"!a in {"a"}"#, &[&[("a", "b")]], &[]),
    (r#"a in {"a", "b"}"#, &[&[("a", "a")]], &[]),
    (r#"a in {"a", "b"}"#, &[&[("a", "b")]], &[]),
    (r#"a not in {"d", "e"}"#, &[&[("a", "a")]], &[]),
    (r#"has(a)"#, &[&[("a", "b")]], &[]),
    (r#"!has(a)"#, &[&[("b", "b")]], &[]),
    (r#""#, &[&[]], &[]),
    (r#" "#, &[&[]], &[]),
    (r#""#, &[&[("a", "b")]], &[]),
    (r#"all()"#, &[&[]], &[]),
    (r#" all()"#, &[&[]], &[]),
    (r#" all()"#, &[&[("a", "b")]], &[]),
    (r#"global()"#, &[&[]], &[]),
    (r#" global()"#, &[&[]], &[]),
    (r#" global()"#, &[&[("a", "b")]], &[]),
    (r#"a == 'a'"#, &[], &[&[("a", "b")]]),
    (r#"a == 'a'"#, &[], &[&[]]),
    (r#"a != "a""#, &[], &[&[("a", "a")]]),
    (r#"a != 'a'"#, &[], &[&[("a", "a")]]),
    (r#"a in {"a"}"#, &[], &[&[("a", "b")]]),
    (r#"a not in {"a"}"#, &[], &[&[("a", "a")]]),
    (r#"a in {"a", "b"}"#, &[], &[&[("a", "c")]]),
    (r#"has(b)"#, &[], &[&[("a", "b")]]),
    (r#"!!has(b)"#, &[], &[&[("a", "b")]]),
    (r#"! has(a)"#, &[], &[&[("a", "b")]]),
    (r#"!has(a)"#, &[], &[&[("a", "b")]]),
    (r#"!!! has(a)"#, &[], &[&[("a", "b")]]),
    (r#"!!!has(a)"#, &[], &[&[("a", "b")]]),
    (r#"!! ! has(a)"#, &[], &[&[("a", "b")]]),
    (r#"! !!has(a)"#, &[], &[&[("a", "b")]]),
    // Boolean expressions...
    (
        r#"a == 'a1' && b == 'b1'"#,
        &[&[("a", "a1"), ("b", "b1")]],
        &[],
    ),
    (
        r#"a == 'a1' && b != 'b1'"#,
        &[],
        &[&[("a", "a1"), ("b", "b1")]],
    ),
    (
        r#"a != 'a1' && b == 'b1'"#,
        &[],
        &[&[("a", "a1"), ("b", "b1")]],
    ),
    (
        r#"a != 'a1' && b != 'b1'"#,
        &[],
        &[&[("a", "a1"), ("b", "b1")]],
    ),
    (
        r#"a != 'a1' && !b == 'b1'"#,
        &[],
        &[&[("a", "a1"), ("b", "b1")]],
    ),
    (
        r#"!a == 'a1' && b == 'b1'"#,
        &[],
        &[&[("a", "a1"), ("b", "b1")]],
    ),
    (r#"has(a) && !has(b)"#, &[&[("a", "a")]], &[]),
    (r#"!has(b) && has(a)"#, &[&[("a", "a")]], &[]),
    (r#"!(!has(a) || has(b))"#, &[&[("a", "a")]], &[]),
    (r#"!(has(b) || !has(a))"#, &[&[("a", "a")]], &[]),
    (
        r#"a == 'a1' || b == 'b1'"#,
        &[&[("a", "a1"), ("b", "b1")]],
        &[],
    ),
    (
        r#"a == 'a1' || b != 'b1'"#,
        &[&[("a", "a1"), ("b", "b1")]],
        &[],
    ),
    (
        r#"a != 'a1' || b == 'b1'"#,
        &[&[("a", "a1"), ("b", "b1")]],
        &[],
    ),
    (
        r#"a != 'a1' || b != 'b1'"#,
        &[],
        &[&[("a", "a1"), ("b", "b1")]],
    ),
    (
        r#"! a == 'a1' || ! b == 'b1'"#,
        &[],
        &[&[("a", "a1"), ("b", "b1")]],
    ),
];

/// Calico's `badSelectors`.
const CALICO_BAD_SELECTORS: &[&str] = &[
    "b == b",          // label == label
    "b contains b",    // label contains label
    "b starts with b", // label starts with label
    "b ends with b",   // label ends with label
    "'b1' == b",       // literal on lhs
    "b",               // bare label
    "a b",             // Garbage
    "!",               // Garbage
    r#"foo == "bar" &"#,
    r#"foo == "bar" |"#,
    r#"foo != ||"#,
    r#"foo in {"", ||"#,
    r#"foo in """#, // Expect set literal
    r#""FOO"#,      // Unterminated string
    r#""FOO'"#,     // Unterminated string
    r#"'FOO"#,      // Unterminated string
    r#"("#,         // Unterminated paren
    r#"(a == "foo""#,
    r#")"#,
    r#"()"#,
    r#"%"#, // Unexpected char
    r#"a == "b" && %"#,
    r#"a == "b" || %"#,
    r#"a "#,          // should be followed by operator
    r#"has(foo) &&"#, // should be followed by operator
];

/// Calico's `canonicalisationTests` (input, canonical form).
const CALICO_CANONICAL_FORMS: &[(&str, &str)] = &[
    ("", "all()"),
    (" all() ", "all()"),
    (" (all() )", "all()"),
    ("! (has( b)||! has(a ))", "!(has(b) || !has(a))"),
    (r#"! (a == "b"&&! c != "d")"#, r#"!(a == "b" && !c != "d")"#),
    (r#"a == "'""#, r#"a == "'""#),
    (r#"a == '"'"#, r#"a == '"'"#),
    (r#"a contains '"'"#, r#"a contains '"'"#),
    (r#"a contains "'""#, r#"a contains "'""#),
    (r#"a startswith '"'"#, r#"a starts with '"'"#),
    (r#"a endswith "'""#, r#"a ends with "'""#),
    (r#"a!='"'"#, r#"a != '"'"#),
    // Set items get sorted/de-duped.
    (r#"a in {"d"}"#, r#"a in {"d"}"#),
    (r#"a in {"a", "b"}"#, r#"a in {"a", "b"}"#),
    (r#"a in {"d", "a", "b"}"#, r#"a in {"a", "b", "d"}"#),
    (
        r#"a in {"z", "x", "y", "a"}"#,
        r#"a in {"a", "x", "y", "z"}"#,
    ),
    (
        r#"a in {"z", "z", "x", "y", "x", "a"}"#,
        r#"a in {"a", "x", "y", "z"}"#,
    ),
];

#[test]
fn calico_selector_tests_match_and_do_not_match_as_upstream() {
    for (text, matching, not_matching) in CALICO_SELECTOR_TESTS {
        let selector = parse(text);
        let canonical = parse(&selector.to_string());
        for pairs in *matching {
            let labels = labels(pairs);
            assert!(
                selector.matches(&labels),
                "{text:?} should match {labels:?}"
            );
            assert!(
                canonical.matches(&labels),
                "{text:?} canonicalised as {canonical} should match {labels:?}"
            );
        }
        for pairs in *not_matching {
            let labels = labels(pairs);
            assert!(
                !selector.matches(&labels),
                "{text:?} should not match {labels:?}"
            );
            assert!(
                !canonical.matches(&labels),
                "{text:?} canonicalised as {canonical} should not match {labels:?}"
            );
        }
    }
}

#[test]
fn calico_bad_selectors_are_rejected_with_a_position_inside_the_text() {
    for text in CALICO_BAD_SELECTORS {
        match Selector::parse(text) {
            Ok(parsed) => panic!("{text:?} should be rejected, parsed as {parsed}"),
            Err(error) => assert!(
                error.offset <= text.chars().count(),
                "{text:?}: offset {} past the end",
                error.offset
            ),
        }
    }
}

#[test]
fn calico_canonical_forms_are_reproduced_and_round_trip() {
    for (input, expected) in CALICO_CANONICAL_FORMS {
        let selector = parse(input);
        assert_eq!(
            selector.to_string(),
            *expected,
            "canonical form of {input:?}"
        );
        let again = parse(expected);
        assert_eq!(
            again, selector,
            "{expected:?} parses back to the same selector"
        );
        assert_eq!(again.to_string(), *expected);
    }
}

#[test]
fn empty_and_blank_selectors_are_all() {
    for text in ["", " ", "\t ", "all()", "all( )"] {
        assert_eq!(parse(text), Selector::all(), "{text:?}");
        assert!(parse(text).selects_everything());
    }
    assert!(parse("global()").selects_everything());
    assert!(!parse("has(a)").selects_everything());
    assert_eq!(Selector::default(), Selector::all());
}

#[test]
fn operators_bind_as_in_calico_not_then_and_then_or() {
    assert_eq!(
        parse(r#"a == "1" || b == "2" && !has(c)"#).expr(),
        &Expr::Or(vec![
            Expr::Equals {
                key: "a".into(),
                value: "1".into()
            },
            Expr::And(vec![
                Expr::Equals {
                    key: "b".into(),
                    value: "2".into()
                },
                Expr::Not(Box::new(Expr::Has("c".into()))),
            ]),
        ])
    );
    // `!` applies to the operation that follows, not to the rest of the conjunction.
    let selector = parse(r#"!a == "1" && b == "2""#);
    assert!(selector.matches(&labels(&[("b", "2")])));
    assert!(!selector.matches(&labels(&[("a", "1"), ("b", "2")])));
}

#[test]
fn label_keys_take_calicos_charset_and_keywords_are_keys_where_a_key_is_expected() {
    let selector = parse(r#"topology.kubernetes.io/zone == "z1" && my_key-2 in {'x'}"#);
    assert!(selector.matches(&labels(&[
        ("topology.kubernetes.io/zone", "z1"),
        ("my_key-2", "x")
    ])));
    // `has`, `all`, `in` and `contains` are plain keys unless they are followed by `(` (has/all)
    // or come right after a key (operators).
    let selector = parse(r#"has == "1" && all == "2" && in == "3" && contains == "4""#);
    assert!(selector.matches(&labels(&[
        ("has", "1"),
        ("all", "2"),
        ("in", "3"),
        ("contains", "4")
    ])));
    assert_eq!(parse("has(has)").expr(), &Expr::Has("has".into()));
}

#[test]
fn sets_accept_calicos_trailing_comma_and_the_empty_set() {
    assert_eq!(parse(r#"a in {"x", "y",}"#), parse(r#"a in {"y", "x"}"#));
    let empty = parse("a in {}");
    assert_eq!(empty.to_string(), "a in {}");
    assert!(!empty.matches(&labels(&[("a", "")])));
    assert!(parse("a not in {}").matches(&labels(&[("a", "")])));
}

#[test]
fn values_keep_spaces_and_unicode_and_empty_strings_compare() {
    let selector = parse(r#"name == "größe x" && empty == '' && a != "é""#);
    assert!(selector.matches(&labels(&[("name", "größe x"), ("empty", "")])));
    assert_eq!(
        selector.to_string(),
        r#"(name == "größe x" && empty == "" && a != "é")"#
    );
}

#[test]
fn double_negation_through_parentheses_round_trips_as_written() {
    let selector = parse("!(!has(a))");
    assert_eq!(
        selector.expr(),
        &Expr::Not(Box::new(Expr::Not(Box::new(Expr::Has("a".into())))))
    );
    assert_eq!(selector.to_string(), "!(!has(a))");
    assert_eq!(parse(&selector.to_string()), selector);
    assert!(selector.matches(&labels(&[("a", "")])));
}

fn error(text: &str) -> SelectorError {
    match Selector::parse(text) {
        Ok(parsed) => panic!("{text:?} should be rejected, parsed as {parsed}"),
        Err(error) => error,
    }
}

#[test]
fn errors_name_the_character_offset_what_was_expected_and_what_was_found() {
    let e = error(r#"rack == r1"#);
    assert_eq!((e.offset, e.expected.as_str()), (8, "a quoted string"));
    assert_eq!(e.found, r#"label "r1""#);
    assert_eq!(
        e.to_string(),
        r#"invalid selector at character 8: expected a quoted string, found label "r1""#
    );

    let e = error(r#"rack = "r1""#);
    assert_eq!((e.offset, e.expected.as_str()), (5, r#""==""#));

    // A lone `&` or `|` is a misspelt operator, not the start of a label.
    let e = error(r#"a == "b" & c == "d""#);
    assert_eq!((e.offset, e.expected.as_str()), (9, r#""&&""#));
    let e = error(r#"a == "b" | c == "d""#);
    assert_eq!((e.offset, e.expected.as_str()), (9, r#""||""#));

    let e = error(r#"rack is "r1""#);
    assert_eq!(e.offset, 5);
    assert!(e.expected.starts_with("an operator"), "{e}");
    assert_eq!(e.found, r#""is""#);

    let e = error(r#"has(rack) && "#);
    assert_eq!((e.offset, e.found.as_str()), (13, "end of input"));

    let e = error(r#"(a == "b""#);
    assert_eq!(e.offset, 9);
    assert_eq!(e.expected, r#""&&", "||" or ")""#);

    let e = error(r#"a == "b")"#);
    assert_eq!((e.offset, e.found.as_str()), (8, r#"")""#));

    let e = error(r#"zone in {"a" "b"}"#);
    assert_eq!((e.offset, e.expected.as_str()), (13, r#""," or "}""#));
    // A comma only follows a string, as in Calico's parser.
    let e = error(r#"zone in {,}"#);
    assert_eq!(
        (e.offset, e.expected.as_str()),
        (9, r#"a quoted string or "}""#)
    );
    let e = error(r#"zone in {"a",,"b"}"#);
    assert_eq!(
        (e.offset, e.expected.as_str()),
        (13, r#"a quoted string or "}""#)
    );

    let e = error(r#"zone in "a""#);
    assert_eq!(e.offset, 8);
    assert!(e.expected.starts_with("a set of strings"), "{e}");

    let e = error(r#"a starts "x""#);
    assert_eq!((e.offset, e.expected.as_str()), (9, r#""with""#));

    let e = error("has( ) ");
    assert_eq!(e.offset, 5);
    assert!(e.expected.contains("label name"), "{e}");

    let e = error(r#"a == 'b"#);
    assert_eq!(e.offset, 5);
    assert_eq!(e.found, "an unterminated string");

    // Offsets count characters, not bytes; label keys are ASCII.
    let e = error(r#"größe == "x""#);
    assert_eq!((e.offset, e.found.as_str()), (2, r#""ö""#));
    let e = error(r#"a == "größe" && %"#);
    assert_eq!((e.offset, e.found.as_str()), (16, r#""%""#));
    let e = error(r#"a == "é" b"#);
    assert_eq!(e.offset, 9);

    // A newline is not whitespace in Calico's tokenizer.
    let e = error("has(a)\n");
    assert_eq!(e.offset, 6);
}

#[test]
fn nesting_deeper_than_the_limit_is_an_error_not_a_stack_overflow() {
    let deep_enough = format!(
        "{}has(a){}",
        "(".repeat(MAX_SELECTOR_NESTING),
        ")".repeat(MAX_SELECTOR_NESTING)
    );
    assert_eq!(parse(&deep_enough).expr(), &Expr::Has("a".into()));
    let too_deep = format!("{}has(a)", "(".repeat(100_000));
    let e = error(&too_deep);
    assert_eq!(e.offset, MAX_SELECTOR_NESTING);
    // Long runs of `!` collapse without recursion.
    assert_eq!(
        parse(&format!("{}has(a)", "!".repeat(100_001))).expr(),
        &Expr::Not(Box::new(Expr::Has("a".into())))
    );
}

#[test]
fn serde_stores_the_canonical_text_and_reads_it_back_by_parsing() {
    let selector = parse("rack in {'r2','r1'} && !has(drain)");
    assert_eq!(
        selector.to_string(),
        r#"(rack in {"r1", "r2"} && !has(drain))"#
    );
    let bytes = crate::model::encode(&selector).expect("encode");
    let as_text: String = crate::model::decode("k", &bytes).expect("decode as text");
    assert_eq!(as_text, selector.to_string());
    let back: Selector = crate::model::decode("k", &bytes).expect("decode");
    assert_eq!(back, selector);
    let bad = crate::model::encode(&"a ==".to_owned()).expect("encode");
    let refused = crate::model::decode::<Selector>("k", &bad);
    assert!(
        matches!(refused, Err(IpamError::Corrupt { .. })),
        "{refused:?}"
    );
}

#[test]
fn from_str_is_parse() {
    let text = r#"rack == "r1" || has(edge)"#;
    assert_eq!(text.parse::<Selector>(), Ok(parse(text)));
    assert_ne!(text.parse::<Selector>(), Ok(Selector::all()));
    assert_eq!("a ==".parse::<Selector>(), Err(error("a ==")));
}

#[test]
fn selector_errors_convert_to_invalid_argument() {
    let e: IpamError = error("a ==").into();
    assert!(
        matches!(&e, IpamError::InvalidArgument(m) if m.contains("at character 4")),
        "{e}"
    );
}

// ---------------------------------------------------------------------------------------------
// Property tests
// ---------------------------------------------------------------------------------------------

fn key_strategy() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("a".to_owned()),
        Just("b".to_owned()),
        Just("k8s.io/zone".to_owned()),
        "[a-z0-9_./-]{1,6}",
    ]
}

fn value_strategy() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        Just("x".to_owned()),
        Just("xy".to_owned()),
        Just("'".to_owned()),
        Just("\"".to_owned()),
        "[xy é'\"]{0,4}",
    ]
    .prop_filter("one literal never holds both quotes", |v| {
        !(v.contains('"') && v.contains('\''))
    })
}

fn expr_strategy() -> impl Strategy<Value = Expr> {
    let set = || prop::collection::btree_set(value_strategy(), 0..4);
    let leaf = prop_oneof![
        Just(Expr::All),
        Just(Expr::Global),
        key_strategy().prop_map(Expr::Has),
        (key_strategy(), value_strategy()).prop_map(|(key, value)| Expr::Equals { key, value }),
        (key_strategy(), value_strategy()).prop_map(|(key, value)| Expr::NotEquals { key, value }),
        (key_strategy(), value_strategy()).prop_map(|(key, value)| Expr::Contains { key, value }),
        (key_strategy(), value_strategy()).prop_map(|(key, value)| Expr::StartsWith { key, value }),
        (key_strategy(), value_strategy()).prop_map(|(key, value)| Expr::EndsWith { key, value }),
        (key_strategy(), set()).prop_map(|(key, values)| Expr::In { key, values }),
        (key_strategy(), set()).prop_map(|(key, values)| Expr::NotIn { key, values }),
    ];
    leaf.prop_recursive(4, 24, 4, |inner| {
        prop_oneof![
            inner.clone().prop_map(|e| Expr::Not(Box::new(e))),
            prop::collection::vec(inner.clone(), 2..4).prop_map(Expr::And),
            prop::collection::vec(inner, 2..4).prop_map(Expr::Or),
        ]
    })
}

fn labels_strategy() -> impl Strategy<Value = BTreeMap<String, String>> {
    prop::collection::btree_map(key_strategy(), value_strategy(), 0..4)
}

/// A small deterministic source of layout choices for [`render_loosely`].
struct Choices(u64);

impl Choices {
    fn next(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }

    fn space(&mut self) -> &'static str {
        ["", " ", "  ", "\t"][self.next(4) as usize]
    }

    fn some_space(&mut self) -> &'static str {
        [" ", "  ", "\t"][self.next(3) as usize]
    }

    fn literal(&mut self, value: &str) -> String {
        let quote = if value.contains('"') {
            '\''
        } else if value.contains('\'') || self.next(2) == 0 {
            '"'
        } else {
            '\''
        };
        format!("{quote}{value}{quote}")
    }
}

/// Writes `expr` the way people do: random spacing and quotes, `startswith`/`notin`, extra
/// parentheses, `!!`, duplicate set members and trailing commas, all meaning the same.
fn render_loosely(expr: &Expr, choices: &mut Choices) -> String {
    let operand = |key: &str, operator: &str, value: &str, choices: &mut Choices| {
        format!(
            "{key}{}{operator}{}{}",
            choices.some_space(),
            choices.space(),
            choices.literal(value)
        )
    };
    let set = |values: &BTreeSet<String>, choices: &mut Choices| {
        let mut items: Vec<String> = values.iter().map(|v| choices.literal(v)).collect();
        if let Some(first) = values.iter().next() {
            if choices.next(3) == 0 {
                items.push(choices.literal(first));
            }
        }
        items.reverse();
        let trailing = if !items.is_empty() && choices.next(3) == 0 {
            ","
        } else {
            ""
        };
        let separator = format!(",{}", choices.space());
        format!("{{{}{}}}", items.join(&separator), trailing)
    };
    let text = match expr {
        Expr::All => format!("all({})", choices.space()),
        Expr::Global => format!("global({})", choices.space()),
        Expr::Has(key) => format!("has({}{key}{})", choices.space(), choices.space()),
        Expr::Equals { key, value } => {
            let sp = choices.space();
            format!("{key}{sp}=={}{}", choices.space(), choices.literal(value))
        }
        Expr::NotEquals { key, value } => {
            let sp = choices.space();
            format!("{key}{sp}!={}{}", choices.space(), choices.literal(value))
        }
        Expr::Contains { key, value } => operand(key, "contains", value, choices),
        Expr::StartsWith { key, value } => {
            let operator = ["starts with", "startswith", "starts\twith"][choices.next(3) as usize];
            operand(key, operator, value, choices)
        }
        Expr::EndsWith { key, value } => {
            let operator = ["ends with", "endswith"][choices.next(2) as usize];
            operand(key, operator, value, choices)
        }
        Expr::In { key, values } => {
            format!(
                "{key}{}in{}{}",
                choices.some_space(),
                choices.space(),
                set(values, choices)
            )
        }
        Expr::NotIn { key, values } => {
            let operator = ["not in", "notin", "not  in"][choices.next(3) as usize];
            format!(
                "{key}{}{operator}{}{}",
                choices.some_space(),
                choices.space(),
                set(values, choices)
            )
        }
        Expr::Not(inner) => {
            let inner_text = render_loosely(inner, choices);
            match inner.as_ref() {
                // `!!x` would collapse to `x`: keep the inner negation in parentheses.
                Expr::Not(_) => format!("!{}({inner_text})", choices.space()),
                _ if choices.next(3) == 0 => format!("!{}!!{inner_text}", choices.space()),
                _ => format!("!{}{inner_text}", choices.space()),
            }
        }
        Expr::And(operands) | Expr::Or(operands) => {
            let operator = if matches!(expr, Expr::And(_)) {
                "&&"
            } else {
                "||"
            };
            let parts: Vec<String> = operands
                .iter()
                .map(|o| render_loosely(o, choices))
                .collect();
            let separator = format!("{}{operator}{}", choices.space(), choices.space());
            format!(
                "({}{}{})",
                choices.space(),
                parts.join(&separator),
                choices.space()
            )
        }
    };
    if choices.next(5) == 0 {
        format!("({}{text}{})", choices.space(), choices.space())
    } else {
        text
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// The canonical form of any expression parses back to exactly that expression.
    #[test]
    fn canonical_form_parses_back_to_the_same_expression(expr in expr_strategy()) {
        let text = expr.to_string();
        let parsed = Selector::parse(&text).map_err(|e| TestCaseError::fail(format!("{text:?}: {e}")))?;
        prop_assert_eq!(parsed.expr(), &expr, "{}", text);
        prop_assert_eq!(parsed.to_string(), text);
    }

    /// Loosely written selectors parse to exactly the expression written, and display(parse(s))
    /// parses to the same expression and evaluates the same.
    #[test]
    fn loose_text_round_trips_through_the_canonical_form(
        expr in expr_strategy(),
        seed in 1u64..,
        label_sets in prop::collection::vec(labels_strategy(), 1..8),
    ) {
        let text = render_loosely(&expr, &mut Choices(seed));
        let parsed = Selector::parse(&text).map_err(|e| TestCaseError::fail(format!("{text:?}: {e}")))?;
        let canonical = parsed.to_string();
        let reparsed = Selector::parse(&canonical).map_err(|e| TestCaseError::fail(format!("{canonical:?}: {e}")))?;
        prop_assert_eq!(&reparsed, &parsed, "{} -> {}", text, canonical);
        prop_assert_eq!(parsed.expr(), &expr, "{}", text);
        for labels in &label_sets {
            prop_assert_eq!(parsed.matches(labels), expr.matches(labels), "{} on {:?}", text, labels);
            prop_assert_eq!(reparsed.matches(labels), parsed.matches(labels), "{} on {:?}", canonical, labels);
        }
    }

    /// Any text made of selector fragments either parses (and then round-trips) or is an error
    /// whose offset lies inside the text; nothing panics.
    #[test]
    fn arbitrary_fragments_parse_and_round_trip_or_fail_inside_the_text(
        fragments in prop::collection::vec(prop::sample::select(vec![
            "a", "b.c/d", "==", "!=", "!", "&&", "||", "&", "|", "=", "(", ")", "{", "}", ",",
            "\"x\"", "'y'", "\"", "'", "in", "not", "not in", "has(a)", "has(", "all()", "global()",
            "contains", "starts with", "ends", " ", "\t", "%", "é", "\n",
        ]), 0..12),
        glue in prop::sample::select(vec!["", " "]),
    ) {
        let text = fragments.join(glue);
        match Selector::parse(&text) {
            Ok(parsed) => {
                let canonical = parsed.to_string();
                let reparsed = Selector::parse(&canonical).map_err(|e| TestCaseError::fail(format!("{canonical:?}: {e}")))?;
                prop_assert_eq!(reparsed, parsed, "{:?}", text);
            }
            Err(error) => prop_assert!(error.offset <= text.chars().count(), "{:?}: {}", text, error),
        }
    }
}
