//! Who believes they hold which address while the run goes on, to catch an address handed to a
//! second pod while the first still holds it (a duplicate), even one released again before the
//! end of the run.

use std::collections::HashMap;
use std::net::IpAddr;

#[derive(Debug, Clone)]
struct Holder {
    container: String,
    /// Its DEL has been sent: once that DEL commits, the address may be handed out again, and the
    /// ledger cannot see when that happens, so a new holder is then no proof of a duplicate.
    releasing: bool,
}

/// The addresses live pods hold, by address.
#[derive(Debug, Default)]
pub struct Ledger {
    holders: HashMap<IpAddr, Holder>,
    duplicates: Vec<String>,
}

impl Ledger {
    /// An ADD returned `ips` to `container`. An address that another pod holds, and whose DEL has
    /// not even been sent, was handed out twice: a duplicate.
    pub fn added(&mut self, container: &str, ips: &[IpAddr]) {
        for ip in ips {
            let previous = self.holders.insert(
                *ip,
                Holder {
                    container: container.to_owned(),
                    releasing: false,
                },
            );
            if let Some(previous) = previous {
                if !previous.releasing {
                    self.duplicates.push(format!(
                        "{ip} was handed to {container} while {} held it",
                        previous.container
                    ));
                }
            }
        }
    }

    /// A DEL of `container` is about to be sent.
    pub fn releasing(&mut self, container: &str, ips: &[IpAddr]) {
        for ip in ips {
            if let Some(holder) = self.holders.get_mut(ip) {
                if holder.container == container {
                    holder.releasing = true;
                }
            }
        }
    }

    /// The DEL of `container` succeeded.
    pub fn released(&mut self, container: &str, ips: &[IpAddr]) {
        for ip in ips {
            if self
                .holders
                .get(ip)
                .is_some_and(|holder| holder.container == container)
            {
                self.holders.remove(ip);
            }
        }
    }

    /// Every duplicate seen, described.
    pub fn duplicates(&self) -> &[String] {
        &self.duplicates
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, last])
    }

    #[test]
    fn an_address_handed_out_twice_is_a_duplicate_unless_its_del_was_sent() {
        let mut ledger = Ledger::default();
        ledger.added("a", &[ip(1)]);
        ledger.added("b", &[ip(1)]);
        assert_eq!(ledger.duplicates().len(), 1, "{:?}", ledger.duplicates());

        let mut ledger = Ledger::default();
        ledger.added("a", &[ip(2)]);
        ledger.releasing("a", &[ip(2)]);
        // b's ADD finished before a's DEL was recorded: legitimate reuse.
        ledger.added("b", &[ip(2)]);
        ledger.released("a", &[ip(2)]);
        // b still holds it: c getting it is a duplicate.
        ledger.added("c", &[ip(2)]);
        assert_eq!(ledger.duplicates().len(), 1, "{:?}", ledger.duplicates());
    }
}
