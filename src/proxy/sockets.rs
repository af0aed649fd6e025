//! Every socket the proxy listens on ([`BoundSet`]), bound before any thread exists, and the
//! same sockets in the runtime ([`Listeners`]); their socket files are removed when the proxy
//! stops ([`SocketFiles`]).

use std::path::PathBuf;

use super::accept::ClientBound;
use super::bind::{self, Bound, StdBound};
use super::error::StartError;
use super::settings::Settings;
use crate::endpoint::ListenAddr;

/// Every socket the proxy listens on, bound before any thread exists.
pub struct BoundSet {
    /// The client listeners (`--listen`).
    pub clients: Vec<StdBound>,
    /// The control socket, in the state directory.
    pub control: std::os::unix::net::UnixListener,
    /// The admin listener (`--admin-listen`).
    pub admin: Option<StdBound>,
}

/// The same sockets, in the runtime.
pub struct Listeners {
    /// The client listeners, which hand out unregistered sockets ([`super::accept`]).
    pub clients: Vec<ClientBound>,
    /// The control socket.
    pub control: tokio::net::UnixListener,
    /// The admin listener.
    pub admin: Option<Bound>,
}

/// What the ready line names.
pub struct Announced {
    /// The client listeners' addresses (ports resolved).
    pub clients: Vec<ListenAddr>,
    /// The admin listener's address.
    pub admin: Option<ListenAddr>,
}

impl BoundSet {
    /// Binds the client, control and admin sockets `settings` names, remembering each socket
    /// file in `sockets` (removed when it drops).
    pub fn bind(settings: &Settings, sockets: &mut SocketFiles) -> Result<BoundSet, StartError> {
        let unsafe_listen = settings.clients.unsafe_listen;
        // Another user allowed (root needs no file permission): the sockets admit by peer uid.
        let me = crate::state_dir::own_uid();
        let others = |uids: &[u32]| uids.iter().any(|&u| u != me && u != 0);
        let mut clients = Vec::new();
        for addr in &settings.clients.listen {
            let shared = others(&settings.clients.allow_uids);
            clients.push(sockets.track(bind::bind(addr, unsafe_listen, shared)?));
        }
        // The control socket hands out loopback credentials: the proxy's own user's alone, in
        // its private state directory.
        let control_path = settings.state_dir.control_socket();
        let control = bind::bind_unix(&control_path, 0o600)?;
        sockets.0.push(control_path);
        let admin = match &settings.admin {
            Some(a) => {
                // As its peer check: the admin UNIX socket admits the proxy's own uids alone.
                let shared = others(&a.allow_uids);
                Some(sockets.track(bind::bind(&a.listen, unsafe_listen, shared)?))
            }
            None => None,
        };
        Ok(BoundSet {
            clients,
            control,
            admin,
        })
    }

    /// The UNIX socket files of the client and admin listeners.
    pub fn socket_paths(&self) -> Vec<PathBuf> {
        self.clients
            .iter()
            .chain(self.admin.iter())
            .filter_map(|b| b.socket_path().map(std::path::Path::to_path_buf))
            .collect()
    }

    /// The listeners for the runtime this is called in.
    pub fn into_tokio(self) -> Result<Listeners, StartError> {
        let control_addr = ListenAddr::Unix(PathBuf::new());
        self.control
            .set_nonblocking(true)
            .map_err(|source| StartError::Bind {
                addr: control_addr.clone(),
                source,
            })?;
        Ok(Listeners {
            clients: self
                .clients
                .into_iter()
                .map(StdBound::into_accepting)
                .collect::<Result<_, _>>()?,
            control: tokio::net::UnixListener::from_std(self.control).map_err(|source| {
                StartError::Bind {
                    addr: control_addr,
                    source,
                }
            })?,
            admin: self.admin.map(StdBound::into_tokio).transpose()?,
        })
    }
}

impl Listeners {
    /// The client listeners' addresses (ports resolved).
    pub fn client_addrs(&self) -> Vec<ListenAddr> {
        self.clients.iter().map(ClientBound::addr).collect()
    }

    /// What the ready line names.
    pub fn addrs(&self) -> Announced {
        Announced {
            clients: self.client_addrs(),
            admin: self.admin.as_ref().map(Bound::addr),
        }
    }
}

/// The UNIX socket files the proxy created, removed when this is dropped (so no exit path
/// leaves a socket file that nobody answers on).
#[derive(Default)]
pub struct SocketFiles(Vec<PathBuf>);

impl SocketFiles {
    /// Remembers `bound`'s socket file, if it has one.
    fn track(&mut self, bound: StdBound) -> StdBound {
        if let Some(p) = bound.socket_path() {
            self.0.push(p.to_path_buf());
        }
        bound
    }
}

impl Drop for SocketFiles {
    fn drop(&mut self) {
        for p in &self.0 {
            if let Err(e) = std::fs::remove_file(p) {
                if e.kind() != std::io::ErrorKind::NotFound {
                    tracing::warn!(path = %p.display(), error = %e, "cannot remove socket");
                }
            }
        }
    }
}
