//! The HTTP/JSON admin API (documented in `docs/admin-api.md`) and `/metrics`.
//!
//! Errors come back as `{"error": "..."}` with a status that says who is at
//! fault: 400 bad input, 404 unknown volume or bitmap, 409 name taken,
//! 500 the server's own failure.

use crate::config::parse_size;
use crate::volume_sample;
use crate::ServerState;
use axum::body::Body;
use axum::extract::rejection::JsonRejection;
use axum::extract::{FromRequest, Path, Request, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use bytes::{Bytes, BytesMut};
use ferry_api::{
    BitmapRequest, BitmapView, CreateVolume, ErrorBody, ImportReport, IncomingMigration,
    MigrateRequest, MigrationId, MigrationStatus, RebuildReport, RebuildRequest, ResizeVolume,
    ServerView, Size, VolumeView,
};
use ferry_migration_engine::{self as migration, MigrationError, StorageDaemon};
use ferry_storage::{BitmapInfo, CreateOptions, StorageError, Volume, ZeroMode};
use futures_util::StreamExt;
use serde::de::DeserializeOwned;
use std::sync::Arc;

/// An error answer of the admin API.
#[derive(Debug)]
pub struct ApiError(StatusCode, String);

/// Who is at fault for a storage error.
fn storage_status(e: &StorageError) -> StatusCode {
    match e {
        StorageError::NotFound(_) | StorageError::BitmapNotFound(_) => StatusCode::NOT_FOUND,
        StorageError::Exists(_)
        | StorageError::BitmapExists(_)
        | StorageError::InUse { .. }
        | StorageError::InDoubt { .. }
        | StorageError::Sanitizing(_)
        | StorageError::SanitizeFailed(_)
        | StorageError::Moved { .. }
        | StorageError::HeldElsewhere { .. } => StatusCode::CONFLICT,
        StorageError::Ceph(
            ferry_rbd::RbdError::Exists { .. } | ferry_rbd::RbdError::Locked { .. },
        ) => StatusCode::CONFLICT,
        StorageError::Ceph(ferry_rbd::RbdError::NoImage { .. }) => StatusCode::NOT_FOUND,
        StorageError::Ceph(ferry_rbd::RbdError::BadName(_)) => StatusCode::BAD_REQUEST,
        StorageError::Ceph(_) => StatusCode::BAD_GATEWAY,
        StorageError::InvalidName(_)
        | StorageError::Invalid(_)
        | StorageError::OutOfRange { .. }
        | StorageError::ReadOnly(_) => StatusCode::BAD_REQUEST,
        // A size the pool's file system cannot hold is the caller's to fix.
        _ if matches!(e.raw_os_error(), Some(libc::EFBIG | libc::EINVAL)) => {
            StatusCode::BAD_REQUEST
        }
        StorageError::Io { source, .. }
            if matches!(
                source.kind(),
                std::io::ErrorKind::InvalidInput | std::io::ErrorKind::NotFound
            ) =>
        {
            StatusCode::BAD_REQUEST
        }
        _ if e.raw_os_error() == Some(libc::ENOSPC) => StatusCode::INSUFFICIENT_STORAGE,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

/// Bitmap names the daemon uses itself: the index's, and each migration's.
fn reserved_bitmap(name: &str) -> bool {
    name.starts_with("ferry-") || name.starts_with("migration-")
}

impl From<StorageError> for ApiError {
    fn from(e: StorageError) -> Self {
        ApiError(storage_status(&e), e.to_string())
    }
}

/// Refusals to start a migration: who is at fault decides the status.
impl From<MigrationError> for ApiError {
    fn from(e: MigrationError) -> Self {
        let code = match &e {
            MigrationError::Storage(se) => storage_status(se),
            MigrationError::AlreadyMigrating { .. }
            | MigrationError::IdTaken { .. }
            | MigrationError::VolumeState { .. } => StatusCode::CONFLICT,
            MigrationError::BadRequest(_) => StatusCode::BAD_REQUEST,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        ApiError(code, e.to_string())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.0, Json(ErrorBody { error: self.1 })).into_response()
    }
}

fn bad(msg: impl Into<String>) -> ApiError {
    ApiError(StatusCode::BAD_REQUEST, msg.into())
}

impl From<crate::indexer::IndexerError> for ApiError {
    fn from(e: crate::indexer::IndexerError) -> Self {
        ApiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string())
    }
}

/// A JSON body whose rejections (wrong content type, bad JSON, wrong
/// fields) answer `{"error"}` like every other error.
pub struct ApiJson<T>(pub T);

#[axum::async_trait]
impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        match Json::<T>::from_request(req, state).await {
            Ok(Json(v)) => Ok(ApiJson(v)),
            Err(r) => Err(ApiError(rejection_status(&r), r.body_text())),
        }
    }
}

fn rejection_status(r: &JsonRejection) -> StatusCode {
    match r {
        JsonRejection::MissingJsonContentType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
        JsonRejection::JsonDataError(_) => StatusCode::UNPROCESSABLE_ENTITY,
        _ => StatusCode::BAD_REQUEST,
    }
}

/// Run blocking engine work on a worker thread. Its own error becomes the
/// matching API error; a worker that failed is the server's fault (500).
async fn blocking<T, E>(f: impl FnOnce() -> Result<T, E> + Send + 'static) -> ApiResult<T>
where
    T: Send + 'static,
    E: Send + 'static,
    ApiError: From<E>,
{
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?
        .map_err(ApiError::from)
}

/// The bytes a size names.
fn size_bytes(s: &Size) -> Result<u64, ApiError> {
    match s {
        Size::Bytes(b) => Ok(*b),
        Size::Text(t) => parse_size(t).map_err(|e| bad(e.to_string())),
    }
}

fn bitmap_view(b: BitmapInfo) -> BitmapView {
    BitmapView {
        name: b.name,
        granularity: b.granularity,
        persistent: b.persistent,
        dirty_bytes: b.dirty_bytes,
        dirty_chunks: b.dirty_chunks,
    }
}

fn incoming_view(m: ferry_storage::IncomingMigration) -> IncomingMigration {
    IncomingMigration {
        id: m.id,
        source: m.source,
        started_unix: m.started_unix,
        touched_unix: m.touched_unix,
    }
}

/// A volume as this daemon holds it.
fn view(s: &ServerState, v: &Volume) -> VolumeView {
    let mut out = view_meta(v.meta(), v.allocated_bytes(), v.data_path().to_path_buf());
    out.direct_io = v.direct_io();
    out.dirty_bitmaps = v.bitmaps().into_iter().map(bitmap_view).collect();
    out.sanitize = sanitize_view(v, v.meta().sanitize.as_ref());
    if v.shared() {
        out.gateway = s.pool.gateway_address().map(String::from);
        out.shared = true;
        out.held_here = true;
    }
    out
}

/// A shared volume this gateway does not hold, as the cluster has it.
fn view_elsewhere(sv: ferry_storage::SharedVolume) -> VolumeView {
    let path = match &sv.meta.backing {
        ferry_storage::Backing::Rbd { pool, image } => format!("rbd:{pool}/{image}").into(),
        _ => std::path::PathBuf::new(),
    };
    let mut out = view_meta(sv.meta, sv.allocated_bytes, path);
    out.gateway = sv.holder;
    out.shared = true;
    out
}

fn view_meta(
    m: ferry_storage::VolumeMeta,
    allocated_bytes: u64,
    data_path: std::path::PathBuf,
) -> VolumeView {
    VolumeView {
        name: m.name,
        size: m.size,
        block_size: m.block_size,
        physical_block_size: m.physical_block_size.unwrap_or(m.block_size),
        uuid: m.uuid.to_string(),
        wwn: m.wwn,
        created_unix: m.created_unix,
        backing: match m.backing {
            ferry_storage::Backing::Sparse => ferry_api::Backing::Sparse,
            ferry_storage::Backing::Preallocated => ferry_api::Backing::Preallocated,
            ferry_storage::Backing::External { path } => ferry_api::Backing::External { path },
            ferry_storage::Backing::Rbd { pool, image } => ferry_api::Backing::Rbd { pool, image },
        },
        read_only: m.read_only,
        allocated_bytes,
        data_path,
        direct_io: false,
        dirty_bitmaps: Vec::new(),
        moved_to: m.moved_to,
        moved_admin: m.moved_admin,
        importing: m.importing,
        outgoing: m
            .outgoing
            .map(|o| ferry_api::OutgoingMigration { id: o.id, to: o.to }),
        incoming: m.incoming.map(incoming_view),
        arrived: m.arrived.map(incoming_view),
        sanitize: None,
        shared: false,
        gateway: None,
        held_here: false,
    }
}

/// A running or failed sanitize as the API shows it (`None` when idle).
fn sanitize_view(
    v: &ferry_storage::Volume,
    job: Option<&ferry_storage::SanitizeJob>,
) -> Option<ferry_api::SanitizeView> {
    let op = match job.map(|j| &j.op) {
        Some(ferry_storage::SanitizeOp::Overwrite { .. }) => "overwrite",
        Some(ferry_storage::SanitizeOp::BlockErase) => "block_erase",
        None => "unknown",
    }
    .to_string();
    match v.sanitize_status() {
        ferry_storage::SanitizeStatus::Idle => None,
        ferry_storage::SanitizeStatus::Running { done, total } => {
            Some(ferry_api::SanitizeView::Running {
                op,
                done_bytes: done,
                total_bytes: total,
            })
        }
        ferry_storage::SanitizeStatus::Failed { reason, .. } => {
            Some(ferry_api::SanitizeView::Failed { op, error: reason })
        }
    }
}

type St = State<Arc<ServerState>>;
type ApiResult<T> = Result<T, ApiError>;

/// How the admin API is served: TLS with the pool's identity beyond
/// loopback, and [`access`] per route.
pub fn security(config: &crate::config::Config) -> ferry_trust::api::ApiSecurity {
    ferry_trust::api::ApiSecurity {
        name: "admin API",
        store: Some(migration::tls::CertStore::new(&config.pool)),
        insecure_plaintext: config.admin.insecure_plaintext,
        access,
        limits: ferry_trust::api::API_LIMITS,
    }
}

/// Who besides an operator may call each route: anyone pinned reads; a
/// host drives the migrations of its guests' volumes (start, follow,
/// cancel, release the switch); a controller and a host sample a volume
/// and look its sample's prints up in the index, to price a move.
pub fn access(m: &axum::http::Method, path: &str) -> &'static [ferry_trust::Role] {
    use ferry_trust::api::{changes_state, segments, ANYONE, OPERATOR};
    use ferry_trust::Role::{Controller, Host};
    if !changes_state(m) {
        return ANYONE;
    }
    match (m.as_str(), segments(path).as_slice()) {
        ("POST", ["v1", "volumes", _, "migrate"])
        | ("POST", ["v1", "migrations", _, "switch"])
        | ("DELETE", ["v1", "migrations", _]) => &[Host],
        ("POST", ["v1", "volumes", _, "sample"]) | ("POST", ["v1", "index", "lookup"]) => {
            &[Host, Controller]
        }
        _ => OPERATOR,
    }
}

pub fn router(state: Arc<ServerState>) -> Router {
    Router::new()
        .route("/v1/server", get(server_info))
        .route("/v1/volumes", get(list).post(create))
        .route("/v1/volumes/:name", get(info).delete(delete))
        .route("/v1/volumes/:name/resize", post(resize))
        .route("/v1/volumes/:name/data", get(export).put(import))
        .route(
            "/v1/volumes/:name/bitmaps",
            get(list_bitmaps).post(create_bitmap),
        )
        .route(
            "/v1/volumes/:name/bitmaps/:bitmap",
            get(get_bitmap).delete(delete_bitmap),
        )
        .route(
            "/v1/volumes/:name/bitmaps/:bitmap/clear",
            post(clear_bitmap),
        )
        .route("/v1/index", get(index_status))
        .route("/v1/index/rebuild", post(index_rebuild))
        .route("/v1/index/lookup", post(index_lookup))
        .route("/v1/volumes/:name/sample", post(sample))
        .route("/v1/volumes/:name/migrate", post(migrate))
        .route("/v1/volumes/:name/arrival", get(arrival))
        .route("/v1/migrations", get(list_migrations))
        .route(
            "/v1/migrations/:id",
            get(get_migration).delete(cancel_migration),
        )
        .route("/v1/migrations/:id/events", get(migration_events))
        .route("/v1/migrations/:id/switch", post(release_switch))
        .route("/metrics", get(metrics))
        .with_state(state)
}

async fn server_info(State(s): St) -> Json<ServerView> {
    Json(ServerView {
        version: env!("CARGO_PKG_VERSION").into(),
        pool: s.pool.root().to_path_buf(),
        nbd: s.addrs.nbd.map(|a| a.to_string()),
        admin: s.addrs.admin.map(|a| a.to_string()),
        migration: s.addrs.migration.map(|a| a.to_string()),
        iscsi: s
            .iscsi
            .portals
            .lock()
            .iter()
            .map(|a| a.to_string())
            .collect(),
        iscsi_base_iqn: s.config.iscsi.base_iqn.clone(),
        cert_fingerprint: migration::tls::CertStore::new(s.pool.root())
            .own_cert()
            .ok()
            .map(|c| migration::tls::fingerprint(&c)),
    })
}

/// Every volume here and, on a shared gateway, every shared volume of
/// the cluster, with the gateway that holds it.
async fn list(State(s): St) -> ApiResult<Json<Vec<VolumeView>>> {
    let mut out: Vec<VolumeView> = s.pool.list().iter().map(|v| view(&s, v)).collect();
    let pool = s.pool.clone();
    let others = tokio::task::spawn_blocking(move || pool.shared_elsewhere())
        .await
        .map_err(|e| ApiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))??;
    out.extend(others.into_iter().map(view_elsewhere));
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(Json(out))
}

async fn create(
    State(s): St,
    ApiJson(r): ApiJson<CreateVolume>,
) -> ApiResult<(StatusCode, Json<VolumeView>)> {
    let size = match &r.size {
        Some(sz) => size_bytes(sz)?,
        None if r.path.is_some() => 0,
        None => return Err(bad("size is required")),
    };
    check_size(&s, size)?;
    if let Some(p) = &r.path {
        check_allowed_path(&s.config.storage.allowed_paths, p)?;
    }
    let opts = CreateOptions {
        size,
        block_size: r.block_size.unwrap_or(512),
        physical_block_size: r.physical_block_size,
        preallocate: r.preallocate,
        external: r.path.clone(),
        read_only: r.read_only,
        on_ceph: r.ceph,
        ..CreateOptions::default()
    };
    let pool = s.pool.clone();
    let v = blocking(move || pool.create(&r.name, &opts)).await?;
    tracing::info!(volume = %v.name(), size = v.size(), "volume created");
    if r.path.is_some() {
        // A file made a volume holds its data already: what other volumes
        // will be rebuilt from, as an import's.
        index_in_background(&s, &v, "the volume made of a file");
    }
    Ok((StatusCode::CREATED, Json(view(&s, &v))))
}

/// Hash `v` into the index in the background, in the idle classes
/// (`indexer::index_new_data`); `after` says what brought its data.
fn index_in_background(s: &ServerState, v: &Arc<Volume>, after: &'static str) {
    crate::indexer::index_new_data(s.index.clone(), &s.background_scans, v, after);
}

/// A size within `storage.max_volume_size`.
fn check_size(s: &ServerState, size: u64) -> ApiResult<()> {
    let max = s.config.storage.max_volume_size;
    if size > max {
        return Err(ApiError(
            StatusCode::BAD_REQUEST,
            format!("size {size} is over this daemon's largest volume, {max} bytes (storage.max_volume_size)"),
        ));
    }
    Ok(())
}

/// A file outside the pool becomes a volume only inside one of the
/// configured directories (links resolved first, so a link cannot point
/// out of them).
fn check_allowed_path(allowed: &[std::path::PathBuf], p: &std::path::Path) -> ApiResult<()> {
    let refuse = |why: String| ApiError(StatusCode::FORBIDDEN, why);
    if allowed.is_empty() {
        return Err(refuse(format!(
            "{}: files outside the pool are not made volumes here: add its directory to \
             storage.allowed_paths (ferry serve --allow-path DIR), or import it (ferry volume import)",
            p.display()
        )));
    }
    let real = std::fs::canonicalize(p)
        .map_err(|e| ApiError(StatusCode::BAD_REQUEST, format!("{}: {e}", p.display())))?;
    let inside = allowed
        .iter()
        .any(|dir| std::fs::canonicalize(dir).is_ok_and(|d| real.starts_with(&d) && real != d));
    if !inside {
        return Err(refuse(format!(
            "{} (resolved: {}) is outside storage.allowed_paths ({})",
            p.display(),
            real.display(),
            allowed
                .iter()
                .map(|d| d.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    Ok(())
}

async fn info(State(s): St, Path(name): Path<String>) -> ApiResult<Json<VolumeView>> {
    let v = s.pool.get(&name)?;
    Ok(Json(view(&s, &v)))
}

/// `DELETE /v1/volumes/{name}[?force=true]`.
#[derive(Debug, Default, serde::Deserialize)]
pub struct DeleteQuery {
    #[serde(default)]
    pub force: bool,
}

async fn delete(
    State(s): St,
    Path(name): Path<String>,
    axum::extract::Query(q): axum::extract::Query<DeleteQuery>,
) -> ApiResult<StatusCode> {
    let pool = s.pool.clone();
    let n = name.clone();
    blocking(move || pool.delete(&n, q.force)).await?;
    s.index.remove(&name);
    tracing::info!(volume = %name, "volume deleted");
    Ok(StatusCode::NO_CONTENT)
}

async fn resize(
    State(s): St,
    Path(name): Path<String>,
    ApiJson(r): ApiJson<ResizeVolume>,
) -> ApiResult<Json<VolumeView>> {
    let v = s.pool.get(&name)?;
    let size = size_bytes(&r.size)?;
    check_size(&s, size)?;
    let v2 = v.clone();
    blocking(move || v2.resize(size, r.allow_shrink)).await?;
    Ok(Json(view(&s, &v)))
}

const IO_CHUNK: usize = 1 << 20;

/// Stream a raw image into the volume from offset 0. All-zero chunks become
/// holes (or zeroed ranges) instead of written data.
async fn import(
    State(s): St,
    Path(name): Path<String>,
    body: Body,
) -> ApiResult<Json<ImportReport>> {
    let v = s.pool.get(&name)?;
    let size = v.size();
    // Durably incomplete until the whole image is in and flushed: a crash
    // or a broken upload leaves a volume that says so and is not exported.
    let v2 = v.clone();
    blocking(move || v2.set_importing(true)).await?;
    let mut stream = body.into_data_stream();
    let mut pending = BytesMut::with_capacity(IO_CHUNK);
    let mut offset = 0u64;
    let mut written = 0u64;
    let mut zeroed = 0u64;
    loop {
        let next = stream.next().await;
        let finished = next.is_none();
        if let Some(chunk) = next {
            let chunk = chunk.map_err(|e| bad(format!("reading request body: {e}")))?;
            pending.extend_from_slice(&chunk);
        }
        while pending.len() >= IO_CHUNK || (finished && !pending.is_empty()) {
            let n = pending.len().min(IO_CHUNK);
            let piece = pending.split_to(n).freeze();
            if offset + n as u64 > size {
                return Err(bad(format!(
                    "image is larger than the volume ({size} bytes)"
                )));
            }
            let zero = piece.iter().all(|&b| b == 0);
            let v2 = v.clone();
            let off = offset;
            blocking(move || {
                if zero {
                    v2.write_zeroes(
                        off,
                        piece.len() as u64,
                        ZeroMode {
                            may_punch: true,
                            fast_only: false,
                        },
                        false,
                    )
                } else {
                    v2.write_at(off, &piece, false)
                }
            })
            .await?;
            if zero {
                zeroed += n as u64;
            } else {
                written += n as u64;
            }
            offset += n as u64;
        }
        if finished {
            break;
        }
    }
    let v2 = v.clone();
    blocking(move || {
        v2.flush()?;
        v2.set_importing(false)
    })
    .await?;
    // The imported content is what other volumes will be rebuilt from.
    index_in_background(&s, &v, "the imported volume");
    Ok(Json(ImportReport {
        bytes: offset,
        written,
        zeroed,
    }))
}

/// Stream the whole volume out as a raw image.
async fn export(State(s): St, Path(name): Path<String>) -> ApiResult<Response> {
    let v = s.pool.get(&name)?;
    let size = v.size();
    let stream = futures_util::stream::unfold(0u64, move |off| {
        let v = v.clone();
        async move {
            if off >= size {
                return None;
            }
            let n = usize::try_from(size - off).map_or(IO_CHUNK, |n| n.min(IO_CHUNK));
            let r = tokio::task::spawn_blocking(move || {
                let mut b = vec![0u8; n];
                v.read_at(off, &mut b).map(|()| Bytes::from(b))
            })
            .await;
            let item = match r {
                Ok(Ok(b)) => Ok(b),
                Ok(Err(e)) => Err(std::io::Error::other(e.to_string())),
                Err(e) => Err(std::io::Error::other(e.to_string())),
            };
            Some((item, off + n as u64))
        }
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "application/octet-stream")
        .header(header::CONTENT_LENGTH, size)
        .body(Body::from_stream(stream))
        .map_err(|e| ApiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))
}

async fn list_bitmaps(State(s): St, Path(name): Path<String>) -> ApiResult<Json<Vec<BitmapView>>> {
    Ok(Json(
        s.pool
            .get(&name)?
            .bitmaps()
            .into_iter()
            .map(bitmap_view)
            .collect(),
    ))
}

async fn create_bitmap(
    State(s): St,
    Path(name): Path<String>,
    ApiJson(r): ApiJson<BitmapRequest>,
) -> ApiResult<(StatusCode, Json<BitmapView>)> {
    let v = s.pool.get(&name)?;
    if reserved_bitmap(&r.name) {
        return Err(bad(format!(
            "bitmap name {:?} is reserved (names starting with ferry- or migration- are the daemon's own)",
            r.name
        )));
    }
    let b = v.create_bitmap(&r.name, r.granularity, r.persistent)?;
    Ok((StatusCode::CREATED, Json(bitmap_view(b.info()))))
}

async fn get_bitmap(
    State(s): St,
    Path((name, bm)): Path<(String, String)>,
) -> ApiResult<Json<BitmapView>> {
    Ok(Json(bitmap_view(s.pool.get(&name)?.bitmap(&bm)?.info())))
}

async fn delete_bitmap(
    State(s): St,
    Path((name, bm)): Path<(String, String)>,
) -> ApiResult<StatusCode> {
    s.pool.get(&name)?.delete_bitmap(&bm)?;
    Ok(StatusCode::NO_CONTENT)
}

async fn clear_bitmap(
    State(s): St,
    Path((name, bm)): Path<(String, String)>,
) -> ApiResult<Json<BitmapView>> {
    let b = s.pool.get(&name)?.bitmap(&bm)?;
    if bm == ferry_migration_engine::ARRIVAL_BITMAP {
        return Err(bad(format!(
            "bitmap {bm} is what a return trip trusts to be every block written since the volume arrived: clearing it would send a stale volume home (the digest would refuse it); delete it instead, and the next return prints every block"
        )));
    }
    if bm == crate::indexer::INDEX_BITMAP {
        return Err(bad(format!(
            "bitmap {bm} is what the index's prints trust to be every block written since it was hashed: clearing it would make a migration send stale prints; delete it instead, and the volume is indexed again"
        )));
    }
    b.clear();
    Ok(Json(bitmap_view(b.info())))
}

async fn metrics(State(s): St) -> impl IntoResponse {
    let text = s.metrics.render(&s.pool, &s.index);
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        text,
    )
}

async fn index_status(State(s): St) -> Json<ferry_api::IndexStatus> {
    let st = s.index.status();
    Json(ferry_api::IndexStatus {
        block_size: st.block_size,
        entries: st.entries,
        memory_bytes: st.memory_bytes,
        memory_bytes_per_entry: st.memory_bytes_per_entry,
        disk_bytes: st.disk_bytes,
        lookups: st.lookups,
        hits: st.hits,
        volumes: st
            .volumes
            .into_iter()
            .map(|v| ferry_api::VolumeIndexStatus {
                volume: v.volume,
                entries: v.entries,
                memory_bytes: v.memory_bytes,
                volume_size: v.volume_size,
                prints: v.prints,
            })
            .collect(),
    })
}

/// The most fingerprints one sample or lookup carries.
const SAMPLE_MAX: u64 = 4096;

/// `POST /v1/volumes/NAME/sample`: the fingerprints of runs of blocks
/// spread evenly over the volume, each priced as a migration's stream
/// sends it (zero blocks counted, not fingerprinted; `volume_sample`).
async fn sample(
    State(s): St,
    Path(name): Path<String>,
    ApiJson(b): ApiJson<ferry_api::SampleRequest>,
) -> ApiResult<Json<ferry_api::VolumeSample>> {
    if !(1..=SAMPLE_MAX).contains(&b.blocks) {
        return Err(bad(format!(
            "blocks must be 1 to {SAMPLE_MAX}, not {}",
            b.blocks
        )));
    }
    let v = s.pool.get(&name)?;
    let bs = s.index.block_size();
    let id = v.meta().uuid;
    let switch_hold_s = s.switch_hold.seconds();
    let switch_holds_s = s.switch_hold.kept();
    let move_setups_s = s.move_setup.kept();
    let out = blocking(move || {
        let size = v.size();
        // Where the runs sit in their stretches follows from the volume's
        // identity: the same each time for one volume, unrelated to the
        // layout of a file system on it.
        let blocks =
            volume_sample::sampled_blocks(size / u64::from(bs), b.blocks, id.as_u64_pair().0);
        let read = |block, buf: &mut [u8]| v.read_at(block * u64::from(bs), buf);
        let mut out = volume_sample::price(bs, &blocks, read)?;
        out.volume_size = size;
        out.uuid = Some(id.simple().to_string());
        out.switch_hold_s = switch_hold_s;
        out.switch_holds_s = switch_holds_s;
        out.move_setups_s = move_setups_s;
        // Arrived by a migration and tracked since: what a return to the
        // copy it left would print and send.
        if let Some((arrived_under, written)) = ferry_migration_engine::arrival_tracking(&v, bs) {
            let blocks = volume_sample::sampled_written(&written, b.blocks, id.as_u64_pair().1);
            out.since_arrival = Some(Box::new(ferry_api::WrittenSinceArrival {
                arrived_under,
                blocks: written.dirty_chunks(),
                sample: volume_sample::price(bs, &blocks, read)?,
            }));
        }
        Ok::<_, StorageError>(out)
    })
    .await?;
    Ok(Json(out))
}

/// `POST /v1/index/lookup`: how many of the fingerprints the index holds.
async fn index_lookup(
    State(s): St,
    ApiJson(b): ApiJson<ferry_api::LookupRequest>,
) -> ApiResult<Json<ferry_api::LookupAnswer>> {
    if b.fingerprints.len() as u64 > SAMPLE_MAX {
        return Err(bad(format!(
            "at most {SAMPLE_MAX} fingerprints, not {}",
            b.fingerprints.len()
        )));
    }
    let mut prints = Vec::with_capacity(b.fingerprints.len());
    for h in &b.fingerprints {
        let bytes: Option<Vec<u8>> = (h.len() == 64 && h.is_ascii())
            .then(|| {
                (0..32)
                    .map(|i| u8::from_str_radix(&h[2 * i..2 * i + 2], 16).ok())
                    .collect()
            })
            .flatten();
        let Some(Ok(arr)) = bytes.map(<[u8; 32]>::try_from) else {
            return Err(bad(format!("{h:?} is not a fingerprint (64 hex digits)")));
        };
        prints.push(ferry_index::Fingerprint(arr));
    }
    let copy = b.copy_of.as_ref().and_then(|c| {
        s.pool
            .get(&c.name)
            .ok()
            .zip(uuid::Uuid::parse_str(&c.uuid).ok())
            .filter(|(v, u)| v.is_moved_away_copy_of(u.as_bytes()))
            .map(|(v, _)| (v, c.arrived_under.clone()))
    });
    let holds_copy = copy.is_some();
    // The copy left by the migration the volume arrived where it is by:
    // a return there prints only what was written since.
    let copy_tracked =
        copy.is_some_and(|(v, arrived)| arrived.is_some() && v.left_under() == arrived);
    let shares_extents = s.pool.shares_extents();
    let rebuild_bps = s.rebuild_rate.bytes_per_second();
    let index = s.index.clone();
    let out = blocking(move || {
        let mut missing = Vec::new();
        for (i, fp) in prints.iter().enumerate() {
            if index.lookup(fp, 1)?.is_empty() {
                missing.push(u32::try_from(i).unwrap_or(u32::MAX));
            }
        }
        Ok::<_, crate::indexer::IndexerError>(ferry_api::LookupAnswer {
            asked: prints.len() as u64,
            found: (prints.len() - missing.len()) as u64,
            missing: Some(missing),
            holds_copy,
            copy_tracked,
            shares_extents,
            rebuild_bps,
        })
    })
    .await?;
    Ok(Json(out))
}

async fn index_rebuild(
    State(s): St,
    body: Option<ApiJson<RebuildRequest>>,
) -> ApiResult<Json<Vec<RebuildReport>>> {
    let req = body.map(|b| b.0).unwrap_or_default();
    // A volume named must exist (404 otherwise) before anything runs.
    let named = match &req.volume {
        Some(n) => Some(s.pool.get(n)?),
        None => None,
    };
    let state = s.clone();
    let out = blocking(move || {
        // A shared gateway's index covers every shared volume of its
        // cluster (read where it is), not only what it holds.
        let vols = match named {
            Some(v) => vec![v],
            None => {
                let mut v = state.pool.list();
                let held: std::collections::BTreeSet<String> = v.iter().map(|x| x.name()).collect();
                v.extend(
                    state
                        .pool
                        .shared_readers()?
                        .into_iter()
                        .filter(|r| !held.contains(&r.name())),
                );
                v
            }
        };
        vols.iter()
            .map(|v| {
                let name = v.name();
                let st = crate::indexer::rebuild_volume(&state.index, v)?;
                Ok(RebuildReport {
                    volume: name,
                    bytes: st.bytes,
                    read_bytes: st.read_bytes,
                    blocks: st.blocks,
                    zero_blocks: st.zero_blocks,
                    seconds: st.seconds,
                    mb_per_s: st.rate() / 1e6,
                })
            })
            .collect::<Result<Vec<_>, crate::indexer::IndexerError>>()
    })
    .await?;
    Ok(Json(out))
}

/// `POST /v1/volumes/NAME/migrate`: 202 and the new migration's status,
/// or 200 and the status of the one already started under the same id.
async fn migrate(
    State(s): St,
    Path(name): Path<String>,
    ApiJson(b): ApiJson<MigrateRequest>,
) -> ApiResult<(StatusCode, Json<MigrationStatus>)> {
    use migration::source::{start, MigrateRequest as EngineRequest, Started};
    let d = EngineRequest::default();
    let req = EngineRequest {
        id: b.id,
        volume: name,
        to: b.to,
        plaintext: b.plaintext,
        max_downtime: b
            .max_downtime_ms
            .map_or(d.max_downtime, std::time::Duration::from_millis),
        bwlimit: match &b.bwlimit {
            Some(x) => size_bytes(x)?,
            None => 0,
        },
        max_rounds: b.max_rounds.unwrap_or(d.max_rounds),
        dedup: b.dedup.unwrap_or(true),
        compress: b.compress.unwrap_or(true),
        retry_for: b
            .retry_for_s
            .map_or(d.retry_for, std::time::Duration::from_secs),
        hold_switch: b.hold_switch,
        resolve_only: false,
    };
    let host: Arc<dyn StorageDaemon> = s.clone();
    match start(host, req)? {
        Started::New(run) => Ok((StatusCode::ACCEPTED, Json(run.status()))),
        Started::Existing(run) => Ok((StatusCode::OK, Json(run.status()))),
    }
}

fn migration_id(id: &str) -> ApiResult<MigrationId> {
    id.parse()
        .map_err(|e: ferry_api::migration::BadMigrationId| {
            ApiError(StatusCode::NOT_FOUND, e.to_string())
        })
}

fn run_of(s: &ServerState, id: &str) -> ApiResult<Arc<migration::MigrationRun>> {
    let id = migration_id(id)?;
    s.migrations
        .get(&id)
        .ok_or_else(|| ApiError(StatusCode::NOT_FOUND, format!("no migration {id}")))
}

async fn list_migrations(State(s): St) -> Json<Vec<MigrationStatus>> {
    Json(s.migrations.list().iter().map(|r| r.status()).collect())
}

async fn get_migration(State(s): St, Path(id): Path<String>) -> ApiResult<Json<MigrationStatus>> {
    Ok(Json(run_of(&s, &id)?.status()))
}

async fn cancel_migration(
    State(s): St,
    Path(id): Path<String>,
) -> ApiResult<Json<MigrationStatus>> {
    let r = run_of(&s, &id)?;
    r.cancel.cancel();
    Ok(Json(r.status()))
}

#[derive(Debug, serde::Deserialize)]
pub struct ArrivalQuery {
    migration: String,
    #[serde(default)]
    wait_ms: u64,
}

/// The longest one arrival request waits.
const ARRIVAL_WAIT_MAX: std::time::Duration = std::time::Duration::from_secs(30);

/// `GET /v1/volumes/{name}/arrival?migration=ID&wait_ms=N`: whether
/// migration `ID` has committed its copy of the volume here, waiting up
/// to `N` ms (at most [`ARRIVAL_WAIT_MAX`]) for it: a teleport's
/// destination host learns of its disk's switch here, a one-way trip
/// before the source could tell it.
async fn arrival(
    State(s): St,
    Path(name): Path<String>,
    axum::extract::Query(q): axum::extract::Query<ArrivalQuery>,
) -> ApiResult<Json<ferry_api::ArrivalView>> {
    let id = q
        .migration
        .parse::<MigrationId>()
        .map_err(|e| ApiError(StatusCode::BAD_REQUEST, e.to_string()))?
        .to_string();
    let limit = std::time::Duration::from_millis(q.wait_ms).min(ARRIVAL_WAIT_MAX);
    let known = s
        .arrivals
        .wait(limit, || {
            if let Some(c) = s.arrivals.get(&name, &id) {
                return Some(Some(c));
            }
            // Committed before this daemon started: where to, if that
            // does not depend on the connection the migration came in on.
            let v = s.pool.get(&name).ok()?;
            v.arrived_by(&id).then(|| restarted_since(&s))
        })
        .await;
    let nonempty = |a: String| (!a.is_empty()).then_some(a);
    Ok(Json(ferry_api::ArrivalView {
        volume: name,
        migration: id,
        arrived: known.is_some(),
        location: known.clone().flatten().and_then(|c| nonempty(c.location)),
        admin: known.flatten().and_then(|c| nonempty(c.admin)),
    }))
}

/// Where a copy committed before this daemon's restart sends its clients:
/// its advertised addresses, unless they would be taken from the
/// migration's connection (a listener on an unspecified address).
fn restarted_since(s: &ServerState) -> Option<crate::arrivals::Committed> {
    let specific = |a: String| {
        a.parse::<std::net::SocketAddr>()
            .map_or(!a.is_empty(), |sa| !sa.ip().is_unspecified())
            .then_some(a)
    };
    Some(crate::arrivals::Committed {
        location: specific(s.advertised_nbd(None))?,
        admin: specific(s.advertised_admin(None)).unwrap_or_default(),
    })
}

#[derive(serde::Deserialize)]
struct ReleaseQuery {
    #[serde(default)]
    if_ready: bool,
}

/// `POST /v1/migrations/{id}/switch`: let a migration started with
/// `hold_switch` pause the guest and switch (at once if it is ready, as
/// soon as it converges otherwise). With `?if_ready=true`, only if it is
/// ready now: the answer's `switch_released` says whether it was (a
/// teleport's host releases at the guest's pause this way, one call, and
/// waits for a disk that is not). 409 once it has ended.
async fn release_switch(
    State(s): St,
    Path(id): Path<String>,
    axum::extract::Query(q): axum::extract::Query<ReleaseQuery>,
) -> ApiResult<Json<MigrationStatus>> {
    let r = run_of(&s, &id)?;
    let ended = if q.if_ready {
        r.release_switch_if_ready().is_none()
    } else {
        !r.release_switch()
    };
    if ended {
        return Err(ApiError(
            StatusCode::CONFLICT,
            format!("migration {} has already ended ({})", r.id, r.phase()),
        ));
    }
    Ok(Json(r.status()))
}

/// How often the event stream reports progress between phase changes.
const EVENT_INTERVAL: std::time::Duration = std::time::Duration::from_millis(250);

/// `GET /v1/migrations/{id}/events`: newline-delimited JSON, one
/// `MigrationStatus` at once, then one on every phase change and every
/// 250 ms of progress, the last one when the migration has ended.
async fn migration_events(State(s): St, Path(id): Path<String>) -> ApiResult<Response> {
    let run = run_of(&s, &id)?;
    let changes = run.subscribe();
    let stream = futures_util::stream::unfold(
        (run, changes, None::<MigrationStatus>, false),
        |(run, mut changes, last, done)| async move {
            if done {
                return None;
            }
            if last.is_some() {
                tokio::select! {
                    _ = changes.changed() => {}
                    () = tokio::time::sleep(EVENT_INTERVAL) => {}
                }
            }
            let st = run.status();
            let end = st.phase.is_terminal();
            let mut line = serde_json::to_vec(&st).unwrap_or_default();
            line.push(b'\n');
            Some((
                Ok::<_, std::convert::Infallible>(Bytes::from(line)),
                (run, changes, Some(st), end),
            ))
        },
    );
    Response::builder()
        .header(header::CONTENT_TYPE, "application/x-ndjson")
        .body(Body::from_stream(stream))
        .map_err(|e| ApiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))
}

#[cfg(test)]
mod access_tests {
    use super::access;
    use axum::http::Method;
    use ferry_trust::Role::{self, Controller, Host, Monitor, Operator, Storage};

    fn admits(m: Method, path: &str) -> Vec<Role> {
        let mut r: Vec<Role> = access(&m, path).to_vec();
        r.retain(|x| *x != Operator);
        r.sort();
        r
    }

    /// Every state-changing route of the admin API, and who besides an
    /// operator may call it: a certificate of any other role gets 403.
    #[test]
    fn each_state_changing_route_admits_only_its_roles() {
        let only_operator: [(Method, &str); 10] = [
            (Method::POST, "/v1/volumes"),
            (Method::DELETE, "/v1/volumes/v"),
            (Method::POST, "/v1/volumes/v/resize"),
            (Method::PUT, "/v1/volumes/v/data"),
            (Method::POST, "/v1/volumes/v/bitmaps"),
            (Method::DELETE, "/v1/volumes/v/bitmaps/b"),
            (Method::POST, "/v1/volumes/v/bitmaps/b/clear"),
            (Method::POST, "/v1/index/rebuild"),
            (Method::POST, "/v1/volumes/v/migrate/x"),
            (Method::PATCH, "/v1/volumes/v"),
        ];
        for (m, p) in only_operator {
            assert!(admits(m.clone(), p).is_empty(), "{m} {p}");
        }
        for (m, p) in [
            (Method::POST, "/v1/volumes/v/migrate"),
            (Method::POST, "/v1/migrations/i/switch"),
            (Method::DELETE, "/v1/migrations/i"),
        ] {
            assert_eq!(admits(m.clone(), p), [Host], "{m} {p}");
        }
        for (m, p) in [
            (Method::POST, "/v1/volumes/v/sample"),
            (Method::POST, "/v1/index/lookup"),
        ] {
            assert_eq!(admits(m.clone(), p), [Controller, Host], "{m} {p}");
        }
        for p in [
            "/v1/volumes",
            "/v1/migrations/i/events",
            "/metrics",
            "/v1/server",
        ] {
            assert_eq!(
                admits(Method::GET, p),
                [Controller, Host, Storage, Monitor],
                "{p}"
            );
        }
    }
}
