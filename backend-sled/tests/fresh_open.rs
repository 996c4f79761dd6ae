//! A store whose previous handle is still closing (sled's own lock still taken for a moment, as
//! by the handle that just created the store, under load) opens even with no lock wait: once our
//! inter-process lock is held, sled's lock can only be such a handle, so the open waits it out.

use std::time::Duration;

use backend_sled::{SledConfig, SledStore};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_lock_still_held_by_a_closing_handle_is_waited_out_even_with_no_lock_wait() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("store.sled");
    let config = |create: bool| SledConfig {
        create_if_missing: create,
        ..SledConfig::new(&path).with_lock_wait(Duration::ZERO)
    };
    drop(
        SledStore::open(config(true))
            .await
            .expect("create the store"),
    );
    // A handle that lets go of sled's lock 200 ms from now (without our lock file: as a handle
    // whose owner already gave that up and whose threads are still closing).
    let lingering = sled::Config::new()
        .path(&path)
        .open()
        .expect("open sled directly");
    let closer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200));
        drop(lingering);
    });
    let opened = SledStore::open(config(false)).await;
    closer.join().expect("the closing handle");
    opened.expect("the store opens once the closing handle has let go");
}
