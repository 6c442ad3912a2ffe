//! Serving one of ferry's HTTP APIs (the storage admin API, the host
//! control API, the controller's API and page) so that only callers it has
//! authenticated can change anything.
//!
//! Each connection is either TLS (its first byte is a ClientHello) with a
//! client certificate pinned in the daemon's store, or plaintext. Plaintext
//! is served only on a loopback listener, where the caller is this
//! machine's operator, unless the daemon was started with the loud
//! `--insecure-plaintext-api` switch; beyond loopback it is answered 403.
//! Every request then passes [`guard`]:
//!
//! 1. Over plaintext, the Host header must be a loopback name or the
//!    address the connection reached: a page loaded from elsewhere that
//!    rebinds its DNS name to 127.0.0.1 is refused.
//! 2. A request that changes state (any method but GET, HEAD, OPTIONS)
//!    must say `Content-Type: application/json` (or `application/octet-stream`
//!    for raw data): a browser cannot send those across sites without a
//!    CORS preflight, which no ferry API answers.
//! 3. The caller's role must be one the route admits (the daemon's
//!    [`Access`] table); an operator may call every route.

use crate::listen::{accept_loop, ConnLimits, Refusal};
use crate::{is_loopback_name, CertStore, Peer, Role};
use axum::body::Body;
use axum::http::{header, Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use thiserror::Error;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

/// The roles (besides [`Role::Operator`]) a route admits, from its method
/// and path.
pub type Access = fn(&Method, &str) -> &'static [Role];

/// Every role: routes that only read.
pub const ANYONE: &[Role] = &Role::ALL;
/// Only the operator.
pub const OPERATOR: &[Role] = &[Role::Operator];

/// The simplest table: anyone pinned reads, only an operator changes
/// anything.
pub fn operator_writes(m: &Method, _path: &str) -> &'static [Role] {
    if changes_state(m) {
        OPERATOR
    } else {
        ANYONE
    }
}

/// Longest a client may take to send its first byte and finish the TLS
/// handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// How one API is served.
#[derive(Clone)]
pub struct ApiSecurity {
    /// What the API is, for logs and errors ("admin API").
    pub name: &'static str,
    /// The daemon's identity and pinned peers; `None`: plaintext only.
    pub store: Option<CertStore>,
    /// Serve plaintext beyond loopback, every caller an operator.
    pub insecure_plaintext: bool,
    /// Who may call what.
    pub access: Access,
    pub limits: ConnLimits,
}

/// Default caps of an HTTP API.
pub const API_LIMITS: ConnLimits = ConnLimits {
    max: 256,
    per_peer: 64,
};

#[derive(Debug, Error)]
pub enum ApiError {
    #[error(
        "the {name} would listen on {addr}, beyond loopback, in plaintext: give the daemon \
         a TLS identity, or (only on a network you trust) start it with --insecure-plaintext-api"
    )]
    PlaintextBeyondLoopback {
        name: &'static str,
        addr: SocketAddr,
    },
    #[error("TLS for the {name}: {source}")]
    Tls {
        name: &'static str,
        #[source]
        source: crate::CertError,
    },
    #[error("the {name}'s listener: {source}")]
    Listener {
        name: &'static str,
        #[source]
        source: std::io::Error,
    },
}

/// A listener an API may serve on: checked once ([`check`]: plaintext
/// beyond loopback refused, the TLS configuration built), so a daemon
/// fails at start, before it serves anything, and [`serve`] only serves.
pub struct ApiListener {
    listener: TcpListener,
    addr: SocketAddr,
    sec: ApiSecurity,
    tls: Option<tokio_rustls::TlsAcceptor>,
}

impl ApiListener {
    pub fn new(listener: TcpListener, sec: ApiSecurity) -> Result<ApiListener, ApiError> {
        let addr = listener.local_addr().map_err(|source| ApiError::Listener {
            name: sec.name,
            source,
        })?;
        let tls = check(&sec, addr)?.map(tokio_rustls::TlsAcceptor::from);
        Ok(ApiListener {
            listener,
            addr,
            sec,
            tls,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

/// Who is calling, as established for the connection.
#[derive(Debug, Clone)]
pub enum Caller {
    /// Plaintext over loopback: this machine's operator.
    Local,
    /// Plaintext beyond loopback under `--insecure-plaintext-api`.
    Unauthenticated,
    /// Plaintext beyond loopback without the switch: refused.
    PlaintextRefused,
    /// A pinned client certificate.
    Peer(Peer),
}

impl Caller {
    /// The role this caller acts with.
    pub fn role(&self) -> Option<Role> {
        match self {
            Caller::Local | Caller::Unauthenticated => Some(Role::Operator),
            Caller::PlaintextRefused => None,
            Caller::Peer(p) => Some(p.role),
        }
    }

    fn plaintext(&self) -> bool {
        !matches!(self, Caller::Peer(_))
    }
}

/// What the guard knows of a connection.
#[derive(Debug, Clone)]
struct Conn {
    caller: Caller,
    local: SocketAddr,
}

/// Check that the API may listen on `addr` as configured, and build its
/// TLS configuration (what [`ApiListener::new`] does once).
pub fn check(
    sec: &ApiSecurity,
    addr: SocketAddr,
) -> Result<Option<Arc<rustls::ServerConfig>>, ApiError> {
    let tls = match &sec.store {
        Some(s) => Some(s.api_server_config().map_err(|source| ApiError::Tls {
            name: sec.name,
            source,
        })?),
        None => None,
    };
    let beyond = !addr.ip().is_loopback();
    if beyond && tls.is_none() && !sec.insecure_plaintext {
        return Err(ApiError::PlaintextBeyondLoopback {
            name: sec.name,
            addr,
        });
    }
    if beyond && sec.insecure_plaintext {
        tracing::warn!(
            api = sec.name,
            %addr,
            "INSECURE: plaintext calls from beyond loopback are served as an operator's, \
             with no authentication (--insecure-plaintext-api)"
        );
    }
    let mode = match (&tls, beyond) {
        (Some(_), true) => "TLS with a pinned client certificate required",
        (Some(_), false) => {
            "loopback: plaintext (the local operator) or TLS with a pinned client certificate"
        }
        (None, _) => "plaintext",
    };
    tracing::info!(api = sec.name, %addr, mode, "API listening");
    Ok(tls)
}

/// Serve `router` on `api` until `shutdown`.
pub async fn serve(api: ApiListener, router: axum::Router, shutdown: CancellationToken) {
    let ApiListener {
        listener,
        sec,
        tls: acceptor,
        ..
    } = api;
    let sec = Arc::new(sec);
    let sd = shutdown.clone();
    accept_loop(
        listener,
        sec.limits,
        Arc::new(()),
        shutdown,
        Some(Duration::from_secs(5)),
        move |stream, peer| {
            let (router, sec, acceptor, sd) =
                (router.clone(), sec.clone(), acceptor.clone(), sd.clone());
            async move { connection(stream, peer, router, sec, acceptor, sd).await }
        },
        |mut stream: TcpStream, _peer, why: Refusal| async move {
            let msg = format!("too many connections ({why:?})");
            let _ = stream.write_all(&plain_response(503, &msg)).await;
        },
    )
    .await;
}

fn plain_response(code: u16, msg: &str) -> Vec<u8> {
    let body = serde_json::json!({ "error": msg }).to_string();
    format!(
        "HTTP/1.1 {code} Refused\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

async fn connection(
    stream: TcpStream,
    peer: SocketAddr,
    router: axum::Router,
    sec: Arc<ApiSecurity>,
    acceptor: Option<tokio_rustls::TlsAcceptor>,
    shutdown: CancellationToken,
) {
    let local = match stream.local_addr() {
        Ok(a) => a,
        Err(_) => return,
    };
    let mut first = [0u8; 1];
    match tokio::time::timeout(HANDSHAKE_TIMEOUT, stream.peek(&mut first)).await {
        Ok(Ok(1)) => {}
        _ => return,
    }
    // 0x16: a TLS handshake record.
    if first[0] == 0x16 {
        let Some(acceptor) = acceptor else {
            tracing::warn!(api = sec.name, %peer, "TLS asked of an API without a TLS identity");
            return;
        };
        let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
            Ok(Ok(t)) => t,
            Ok(Err(e)) => {
                tracing::warn!(api = sec.name, %peer, error = %e, "TLS handshake refused");
                return;
            }
            Err(_) => {
                tracing::warn!(api = sec.name, %peer, "TLS handshake timed out");
                return;
            }
        };
        let der = tls
            .get_ref()
            .1
            .peer_certificates()
            .and_then(|c| c.first())
            .map(|c| c.as_ref().to_vec());
        let caller = match (der, &sec.store) {
            (Some(d), Some(store)) => match store.peer(&d) {
                Some(p) => Caller::Peer(p),
                None => return,
            },
            _ => return,
        };
        serve_http(
            TokioIo::new(tls),
            Conn { caller, local },
            router,
            sec,
            shutdown,
        )
        .await;
    } else {
        let caller = if local.ip().is_loopback() {
            Caller::Local
        } else if sec.insecure_plaintext {
            Caller::Unauthenticated
        } else {
            Caller::PlaintextRefused
        };
        serve_http(
            TokioIo::new(stream),
            Conn { caller, local },
            router,
            sec,
            shutdown,
        )
        .await;
    }
}

async fn serve_http<I>(
    io: I,
    conn: Conn,
    router: axum::Router,
    sec: Arc<ApiSecurity>,
    shutdown: CancellationToken,
) where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let svc = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
        let (router, conn, sec) = (router.clone(), conn.clone(), sec.clone());
        async move {
            let req = req.map(Body::new);
            if let Err((code, msg)) = guard(&sec, &conn, &req) {
                return Ok::<_, Infallible>(refuse(code, msg));
            }
            let mut req = req;
            req.extensions_mut().insert(conn.caller.clone());
            router.oneshot(req).await
        }
    });
    let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    let c = builder.serve_connection_with_upgrades(io, svc);
    tokio::pin!(c);
    tokio::select! {
        _ = c.as_mut() => {}
        () = shutdown.cancelled() => {
            c.as_mut().graceful_shutdown();
            let _ = tokio::time::timeout(Duration::from_secs(5), c).await;
        }
    }
}

fn refuse(code: StatusCode, msg: String) -> Response<Body> {
    let body = serde_json::json!({ "error": msg }).to_string();
    Response::builder()
        .status(code)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body))
        .unwrap_or_default()
}

/// Whether a request changes state (and so must not come from a browser
/// page, and needs a role beyond reading).
pub fn changes_state(m: &Method) -> bool {
    !matches!(*m, Method::GET | Method::HEAD | Method::OPTIONS)
}

/// The checks every request passes before its route runs.
/// Why a request is refused: its status and message.
type Refused = (StatusCode, String);

fn guard(sec: &ApiSecurity, conn: &Conn, req: &Request<Body>) -> Result<(), Refused> {
    let (method, path) = (req.method(), req.uri().path());
    if matches!(conn.caller, Caller::PlaintextRefused) {
        return Err((
            StatusCode::FORBIDDEN,
            format!(
                "the {} requires TLS with a pinned client certificate beyond loopback \
                 (make one with `ferry certs identity`, have the daemon trust it, and call \
                 with --tls-dir or FERRY_TLS_DIR)",
                sec.name
            ),
        ));
    }
    if conn.caller.plaintext() {
        let host = req
            .headers()
            .get(header::HOST)
            .and_then(|h| h.to_str().ok())
            .unwrap_or("");
        if !host_is_ours(host, conn.local) {
            tracing::warn!(api = sec.name, host, %path, "refused a request for another host name");
            return Err((
                StatusCode::MISDIRECTED_REQUEST,
                format!(
                    "Host {host:?} is not this API's address: call it by a loopback name or {}",
                    conn.local.ip()
                ),
            ));
        }
    }
    if changes_state(method) {
        let ct = req
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|h| h.to_str().ok())
            .unwrap_or("");
        let essence = ct
            .split(';')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase();
        if essence != "application/json" && essence != "application/octet-stream" {
            return Err((
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                format!(
                    "{method} {path} must be sent with Content-Type: application/json \
                     (was {ct:?}); requests a browser page can forge are refused"
                ),
            ));
        }
    }
    let role = conn.caller.role().unwrap_or(Role::Monitor);
    let admits = (sec.access)(method, path);
    if role != Role::Operator && !admits.contains(&role) {
        let who = match &conn.caller {
            Caller::Peer(p) => format!("certificate {} (sha256 {}…)", p.name, &p.fingerprint[..16]),
            _ => "caller".into(),
        };
        let wanted: Vec<String> = std::iter::once(Role::Operator)
            .chain(admits.iter().copied().filter(|r| *r != Role::Operator))
            .map(|r| r.to_string())
            .collect();
        tracing::warn!(api = sec.name, %method, %path, %role, "refused a call its role does not allow");
        return Err((
            StatusCode::FORBIDDEN,
            format!(
                "{method} {path} needs the role {}; your {who} is pinned as {role}",
                wanted.join(" or ")
            ),
        ));
    }
    Ok(())
}

/// A Host header naming a loopback name or the address the connection
/// reached (with or without a port).
fn host_is_ours(host: &str, local: SocketAddr) -> bool {
    let name = crate::host_of(host);
    if name.is_empty() {
        return false;
    }
    is_loopback_name(name)
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip == local.ip())
}

/// Split a path into its segments (no empty ones), for access tables.
pub fn segments(path: &str) -> Vec<&str> {
    path.split('/').filter(|s| !s.is_empty()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn access(m: &Method, p: &str) -> &'static [Role] {
        if !changes_state(m) {
            return ANYONE;
        }
        match segments(p).as_slice() {
            ["v1", "things", _, "poke"] => &[Role::Controller],
            _ => OPERATOR,
        }
    }

    fn sec() -> ApiSecurity {
        ApiSecurity {
            name: "test API",
            store: None,
            insecure_plaintext: false,
            access,
            limits: API_LIMITS,
        }
    }

    fn conn(caller: Caller) -> Conn {
        Conn {
            caller,
            local: "127.0.0.1:80".parse().unwrap(),
        }
    }

    fn peer(role: Role) -> Caller {
        Caller::Peer(Peer {
            name: "x.pem".into(),
            role,
            fingerprint: "ab".repeat(32),
        })
    }

    fn req(m: Method, path: &str, host: &str, ct: Option<&str>) -> Request<Body> {
        let mut b = Request::builder().method(m).uri(path).header("host", host);
        if let Some(ct) = ct {
            b = b.header("content-type", ct);
        }
        b.body(Body::empty()).unwrap()
    }

    fn status(r: Result<(), Refused>) -> u16 {
        r.err().map_or(200, |(code, _)| code.as_u16())
    }

    #[test]
    fn host_header_must_be_loopback_or_the_address_reached() {
        let c = conn(Caller::Local);
        for h in ["127.0.0.1:80", "localhost:80", "localhost", "[::1]:80"] {
            assert_eq!(
                status(guard(&sec(), &c, &req(Method::GET, "/v1/x", h, None))),
                200,
                "{h}"
            );
        }
        for h in ["evil.example", "evil.example:80", "", "10.1.2.3:80"] {
            assert_eq!(
                status(guard(&sec(), &c, &req(Method::GET, "/v1/x", h, None))),
                421,
                "{h}"
            );
        }
        // Over TLS the certificate authenticates; any name is fine.
        let tls = conn(peer(Role::Monitor));
        assert_eq!(
            status(guard(
                &sec(),
                &tls,
                &req(Method::GET, "/", "a.example", None)
            )),
            200
        );
    }

    #[test]
    fn state_changes_need_json() {
        let c = conn(Caller::Local);
        for ct in [
            None,
            Some("text/plain"),
            Some("application/x-www-form-urlencoded"),
            Some("multipart/form-data; boundary=x"),
        ] {
            assert_eq!(
                status(guard(
                    &sec(),
                    &c,
                    &req(Method::POST, "/v1/x", "localhost", ct)
                )),
                415,
                "{ct:?}"
            );
        }
        for ct in [
            "application/json",
            "application/json; charset=utf-8",
            "Application/JSON",
            "application/octet-stream",
        ] {
            assert_eq!(
                status(guard(
                    &sec(),
                    &c,
                    &req(Method::DELETE, "/v1/x", "localhost", Some(ct))
                )),
                200,
                "{ct}"
            );
        }
    }

    #[test]
    fn roles_are_checked_per_route() {
        let json = Some("application/json");
        let poke = |caller| {
            status(guard(
                &sec(),
                &conn(caller),
                &req(Method::POST, "/v1/things/a/poke", "localhost", json),
            ))
        };
        assert_eq!(poke(peer(Role::Controller)), 200);
        assert_eq!(poke(peer(Role::Operator)), 200);
        assert_eq!(poke(peer(Role::Monitor)), 403);
        assert_eq!(poke(peer(Role::Host)), 403);
        assert_eq!(poke(Caller::Local), 200);
        let other = status(guard(
            &sec(),
            &conn(peer(Role::Controller)),
            &req(Method::DELETE, "/v1/things/a", "x", json),
        ));
        assert_eq!(other, 403);
        assert_eq!(
            status(guard(
                &sec(),
                &conn(peer(Role::Monitor)),
                &req(Method::GET, "/v1/things", "x", None)
            )),
            200
        );
        assert_eq!(
            status(guard(
                &sec(),
                &conn(Caller::PlaintextRefused),
                &req(Method::GET, "/", "x", None)
            )),
            403
        );
    }

    #[test]
    fn plaintext_beyond_loopback_is_refused_at_start() {
        let beyond: SocketAddr = "0.0.0.0:1".parse().unwrap();
        assert!(matches!(
            check(&sec(), beyond),
            Err(ApiError::PlaintextBeyondLoopback { .. })
        ));
        assert!(check(&sec(), "127.0.0.1:1".parse().unwrap()).is_ok());
        let insecure = ApiSecurity {
            insecure_plaintext: true,
            ..sec()
        };
        assert!(check(&insecure, beyond).is_ok());
    }
}
