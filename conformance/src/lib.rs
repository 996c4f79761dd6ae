//! The conformance suite: store factories, the cases every backend must pass, and the macros that
//! expand them into one named `#[test]` per case in each backend's `tests/conformance.rs`.

pub mod cached_reads;
pub mod embedded;
pub mod full_pools;
pub mod hooked;
pub mod integrity;
pub mod ipam;
pub mod kv;
pub mod leaks;
pub mod lifecycle;
pub mod linearizability;
pub mod model_based;
pub mod nodes;
pub mod read_cost;
pub mod repair;
pub mod reservations;
pub mod resize;
pub mod upgrade;

use std::any::Any;
use std::fmt;
use std::sync::Arc;

use std::future::Future;

use ipam_core::KvStore;

/// Re-exported for backends implementing [`StoreFactory`] and [`MultiClientFactory`]
/// (`#[conformance::async_trait]`), so that running the suite needs no dependency of its own.
pub use async_trait::async_trait;

/// Runs one case on a runtime of its own (four worker threads, as the cases assume concurrent
/// clients really run at once); the macros call it, so the caller needs no runtime of its own.
///
/// # Panics
/// When the runtime cannot be built, and whenever the case fails.
pub fn run_case<F: Future<Output = ()>>(case: F) {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .expect("a multi-threaded tokio runtime for the case")
        .block_on(case);
}

/// A store handed to one case, with whatever must live exactly as long as the case does
/// (a temporary directory, a unique etcd key prefix) in `guard`.
pub struct TestStore {
    /// The store under test, empty when handed over.
    pub store: Arc<dyn KvStore>,
    /// Dropped after the case ends; cleans up what the factory created.
    pub guard: Box<dyn Any + Send + Sync>,
}

impl fmt::Debug for TestStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TestStore")
            .field("store", &self.store)
            .finish_non_exhaustive()
    }
}

/// Makes fresh, empty stores of one backend.
#[async_trait]
pub trait StoreFactory: Send + Sync + 'static {
    /// A short backend name used in messages ("sled", "etcd", ...).
    fn backend_name(&self) -> &'static str;

    /// A new, empty store that no other case sees.
    async fn fresh(&self) -> TestStore;
}

/// Several clients of one store handed to one case, with the store's guard (see [`TestStore`]).
pub struct TestClients {
    /// Independent clients of one store, empty when handed over.
    pub clients: Vec<Arc<dyn KvStore>>,
    /// Dropped after the case ends; cleans up what the factory created.
    pub guard: Box<dyn Any + Send + Sync>,
}

impl fmt::Debug for TestClients {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TestClients")
            .field("clients", &self.clients)
            .finish_non_exhaustive()
    }
}

/// Makes fresh, empty stores reached through several independent clients, as separate processes
/// (or, for a cluster, clients of different members) would reach them.
#[async_trait]
pub trait MultiClientFactory: Send + Sync + 'static {
    /// A short backend name used in messages ("etcd cluster", ...).
    fn backend_name(&self) -> &'static str;

    /// `count` clients of one new, empty store that no other case sees.
    async fn fresh_clients(&self, count: usize) -> TestClients;
}

/// Expands every generic storage case into one `#[test]`, inside a module `kv`.
///
/// `$factory` is an expression building a [`StoreFactory`]; it is evaluated once per case.
#[macro_export]
macro_rules! kv_conformance_tests {
    ($factory:expr) => {
        $crate::__expand_cases!(kv, $crate::kv, $factory;
            get_missing_key_is_none,
            create_then_get_returns_value_and_revision,
            create_on_existing_key_is_conflict,
            update_with_current_revision_replaces_value,
            update_with_stale_revision_is_conflict_and_writes_nothing,
            update_on_missing_key_is_conflict,
            delete_missing_key_succeeds,
            delete_at_current_revision_removes_key,
            delete_at_stale_revision_is_conflict_and_keeps_key,
            deleted_key_can_be_created_again,
            transaction_applies_every_op_when_conditions_hold,
            transaction_with_one_failed_condition_writes_nothing,
            a_condition_at_revision_zero_or_the_largest_never_holds,
            conflict_names_first_failed_key,
            transaction_mixing_puts_and_deletes_is_atomic,
            a_list_never_sees_half_a_transaction,
            a_long_list_or_batch_never_sees_half_a_transaction,
            revisions_only_grow_across_keys,
            every_key_put_carries_the_commit_revision,
            failed_transaction_does_not_advance_visible_revisions,
            list_prefix_is_a_string_prefix,
            list_dir_returns_only_children,
            list_is_sorted_by_key,
            empty_prefix_lists_everything,
            list_reports_each_key_revision,
            empty_value_round_trips,
            one_mebibyte_value_round_trips,
            keys_with_slash_colon_and_unicode_round_trip,
            empty_key_is_invalid_argument,
            key_written_twice_in_one_transaction_is_invalid_and_writes_nothing,
            transaction_without_ops_is_invalid,
            too_many_ops_is_invalid_argument,
            oversized_value_is_invalid_argument,
            concurrent_cas_increments_sum_exactly,
            concurrent_creates_of_one_key_have_one_winner,
            read_many_answers_each_read_in_order,
            range_from_the_middle_answers_limit_keys_as_get_does,
            range_from_below_the_prefix_starts_at_its_first_key,
            range_from_past_the_last_key_is_empty,
            range_never_answers_a_key_outside_its_prefix,
            range_with_a_limit_beyond_the_rest_answers_the_rest,
            range_of_limit_0_is_invalid_argument,
            read_many_answers_ranges_beside_gets_and_lists_in_order,
            the_largest_value_and_the_largest_transaction_are_written_whole,
            transaction_over_the_total_size_limit_is_invalid_and_writes_nothing,
            commit_that_changes_nothing_never_goes_backwards,
            no_put_after_holds_until_a_key_under_the_prefix_is_put,
            no_put_after_ignores_keys_outside_the_prefix_and_deletes,
            no_put_after_on_a_prefix_without_keys_holds_until_one_is_put,
            no_put_after_takes_its_place_among_the_conditions,
        );
        $crate::__expand_cases!(linearizability, $crate::linearizability, $factory;
            concurrent_histories_are_linearizable,
        );
    };
}

/// Expands the cases that need several independent clients of one store (for a cluster: each
/// connected to a different member) into `#[test]`s, inside a module
/// `linearizability_across_clients`. `$factory` builds a [`MultiClientFactory`].
#[macro_export]
macro_rules! multi_client_conformance_tests {
    ($factory:expr) => {
        $crate::__expand_cases!(linearizability_across_clients, $crate::linearizability, $factory;
            concurrent_histories_across_clients_are_linearizable,
        );
    };
}

/// Internal: expands a list of case names into `#[test]` functions inside module `$module`.
#[doc(hidden)]
#[macro_export]
macro_rules! __expand_cases {
    ($module:ident, $cases:path, $factory:expr; $($case:ident),+ $(,)?) => {
        mod $module {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[test]
                fn $case() {
                    $crate::run_case(async {
                        let factory = $factory;
                        {
                            use $cases as cases;
                            cases::$case(&factory).await;
                        }
                    });
                }
            )+
        }
    };
}

/// The factory for the in-memory reference store.
#[derive(Debug, Default, Clone, Copy)]
pub struct MemoryFactory;

#[async_trait]
impl StoreFactory for MemoryFactory {
    fn backend_name(&self) -> &'static str {
        "memory"
    }

    async fn fresh(&self) -> TestStore {
        TestStore {
            store: Arc::new(ipam_core::MemoryStore::new()),
            guard: Box::new(()),
        }
    }
}
