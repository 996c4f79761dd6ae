//! Renders the man pages of `blockipamctl` (section 1, one page per command and subcommand) and
//! `blockipam-agent` (section 8) from the clap definitions the binaries themselves parse with.

use blockipam_agent::AgentArgs;
use blockipamctl::Cli;
use clap::{Command, CommandFactory};
use clap_mangen::Man;

/// The manual every page belongs to (the centre of its footer).
const MANUAL: &str = "blockipam";

/// One rendered man page.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ManPage {
    /// The page's name without its section: `blockipamctl`, `blockipamctl-pool-add`.
    pub name: String,
    /// The manual section: `1` (user commands) or `8` (daemons).
    pub section: &'static str,
    /// The page in roff.
    pub roff: String,
}

impl ManPage {
    /// The page's file name, `NAME.SECTION` (`blockipamctl.1`).
    pub fn file_name(&self) -> String {
        format!("{}.{}", self.name, self.section)
    }
}

/// Every page: `blockipamctl` and each of its visible subcommands in section 1, `blockipam-agent`
/// in section 8 (a daemon run by its systemd unit).
pub fn render_all() -> std::io::Result<Vec<ManPage>> {
    let mut pages = Vec::new();
    let mut ctl = Cli::command().disable_help_subcommand(true);
    ctl.build();
    render_tree(ctl, "1", &mut pages)?;
    pages.push(render(AgentArgs::command(), "8")?);
    Ok(pages)
}

/// Renders `command` and, depth first, every subcommand that `--help` shows.
fn render_tree(
    command: Command,
    section: &'static str,
    pages: &mut Vec<ManPage>,
) -> std::io::Result<()> {
    pages.push(render(command.clone(), section)?);
    for subcommand in command.get_subcommands().filter(|s| !s.is_hide_set()) {
        render_tree(subcommand.clone(), section, pages)?;
    }
    Ok(())
}

/// Renders one page; a built subcommand's display name (`blockipamctl-pool-add`) names it.
fn render(command: Command, section: &'static str) -> std::io::Result<ManPage> {
    let name = command
        .get_display_name()
        .unwrap_or_else(|| command.get_name())
        .to_owned();
    let source = format!("blockipam {}", env!("CARGO_PKG_VERSION"));
    let man = Man::new(command)
        .section(section)
        .source(source)
        .manual(MANUAL);
    let mut roff = Vec::new();
    man.render(&mut roff)?;
    let roff = String::from_utf8(roff)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
    Ok(ManPage {
        name,
        section,
        roff,
    })
}

#[cfg(test)]
mod tests {
    use super::{render_all, ManPage};

    fn pages() -> Vec<ManPage> {
        match render_all() {
            Ok(pages) => pages,
            Err(e) => panic!("rendering the man pages failed: {e}"),
        }
    }

    /// The page's `.TH` line (after the string definitions clap_mangen puts first).
    fn title_line(page: &ManPage) -> &str {
        page.roff
            .lines()
            .find(|line| line.starts_with(".TH "))
            .unwrap_or_default()
    }

    fn page<'a>(pages: &'a [ManPage], file_name: &str) -> &'a ManPage {
        match pages.iter().find(|p| p.file_name() == file_name) {
            Some(page) => page,
            None => panic!(
                "no page {file_name} among {:?}",
                pages.iter().map(ManPage::file_name).collect::<Vec<_>>()
            ),
        }
    }

    #[test]
    fn blockipamctl_page_is_section_one_and_lists_its_commands() {
        let pages = pages();
        let ctl = page(&pages, "blockipamctl.1");
        assert!(
            title_line(ctl).starts_with(".TH blockipamctl 1 "),
            "{}",
            ctl.roff
        );
        for command in ["pool", "config", "show", "check", "release", "node"] {
            assert!(
                ctl.roff.contains(&format!("blockipamctl\\-{command}(1)")),
                "blockipamctl.1 does not point at blockipamctl-{command}(1)"
            );
        }
    }

    #[test]
    fn every_blockipamctl_subcommand_has_its_own_page_with_its_flags() {
        let pages = pages();
        let pool_add = page(&pages, "blockipamctl-pool-add.1");
        assert!(pool_add.roff.contains("block\\-size"), "{}", pool_add.roff);
        page(&pages, "blockipamctl-pool-list.1");
        page(&pages, "blockipamctl-check.1");
        assert!(
            !pages.iter().any(|p| p.name.ends_with("-help")),
            "the help subcommand is not a page"
        );
    }

    #[test]
    fn agent_page_is_section_eight_with_its_flags_and_variables() {
        let pages = pages();
        let agent = page(&pages, "blockipam-agent.8");
        assert!(
            title_line(agent).starts_with(".TH blockipam-agent 8 "),
            "{}",
            agent.roff
        );
        for text in [
            "\\-\\-socket",
            "BLOCKIPAM_AGENT_SOCKET",
            "DATASTORE_TYPE",
            "ETCD_PASSWORD",
        ] {
            assert!(agent.roff.contains(text), "blockipam-agent.8 lacks {text}");
        }
    }

    #[test]
    fn every_page_names_the_version_it_documents() {
        let version = format!("blockipam {}", env!("CARGO_PKG_VERSION"));
        for page in pages() {
            let title = title_line(&page);
            assert!(title.contains(&version), "{}: {title}", page.file_name());
        }
    }
}
