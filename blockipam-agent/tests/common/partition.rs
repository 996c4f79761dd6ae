//! A network partition between one node and etcd: a loopback TCP proxy in front of one etcd
//! member that the test cuts (every connection through it dropped, new ones accepted and left
//! silent, as packets lost on the way) and heals.

use std::io;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;

/// The proxy; stops (and drops every connection) when dropped.
pub struct PartitionProxy {
    address: SocketAddr,
    shared: Arc<Shared>,
}

#[derive(Default)]
struct Shared {
    cut: AtomicBool,
    stopped: AtomicBool,
    /// Both ends of every forwarded connection, to drop them when the link is cut.
    forwarded: Mutex<Vec<TcpStream>>,
    /// Connections accepted while cut: held open, never answered.
    silent: Mutex<Vec<TcpStream>>,
}

fn shut_all(streams: &Mutex<Vec<TcpStream>>) {
    for stream in streams.lock().expect("proxy lock").drain(..) {
        let _ = stream.shutdown(Shutdown::Both);
    }
}

impl PartitionProxy {
    /// A proxy to the etcd member at `endpoint` (`http://127.0.0.1:PORT`).
    pub fn start(endpoint: &str) -> PartitionProxy {
        let upstream: SocketAddr = endpoint
            .trim_start_matches("http://")
            .parse()
            .expect("an http://IP:PORT etcd endpoint");
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the partition proxy");
        let address = listener.local_addr().expect("the proxy's address");
        let shared = Arc::new(Shared::default());
        let accepting = Arc::clone(&shared);
        thread::spawn(move || {
            for client in listener.incoming() {
                if accepting.stopped.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(client) = client else { continue };
                if accepting.cut.load(Ordering::SeqCst) {
                    accepting.silent.lock().expect("proxy lock").push(client);
                    continue;
                }
                let _ = forward(client, upstream, &accepting);
            }
        });
        PartitionProxy { address, shared }
    }

    /// The endpoint a node's agent and plugin are given instead of etcd's.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.address)
    }

    /// Cuts the link: every open connection is dropped, and new ones hang unanswered.
    pub fn cut(&self) {
        self.shared.cut.store(true, Ordering::SeqCst);
        shut_all(&self.shared.forwarded);
    }

    /// Heals the link: the connections left hanging are dropped (their clients reconnect), and
    /// new ones are forwarded again.
    pub fn heal(&self) {
        self.shared.cut.store(false, Ordering::SeqCst);
        shut_all(&self.shared.silent);
    }
}

impl Drop for PartitionProxy {
    fn drop(&mut self) {
        self.shared.stopped.store(true, Ordering::SeqCst);
        // Wake the accepting thread so that it sees the stop.
        let _ = TcpStream::connect(self.address);
        shut_all(&self.shared.forwarded);
        shut_all(&self.shared.silent);
    }
}

/// Copies both ways between `client` and a new connection to `upstream`, each direction on its
/// own thread; both ends are recorded so that a cut can drop them.
fn forward(client: TcpStream, upstream: SocketAddr, shared: &Shared) -> io::Result<()> {
    let server = TcpStream::connect(upstream)?;
    {
        let mut forwarded = shared.forwarded.lock().expect("proxy lock");
        forwarded.push(client.try_clone()?);
        forwarded.push(server.try_clone()?);
    }
    for (mut from, mut to) in [(client.try_clone()?, server.try_clone()?), (server, client)] {
        thread::spawn(move || {
            let _ = io::copy(&mut from, &mut to);
            let _ = from.shutdown(Shutdown::Both);
            let _ = to.shutdown(Shutdown::Both);
        });
    }
    Ok(())
}
