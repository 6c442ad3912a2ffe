//! The HTTP/JSON admin API (documented in `docs/admin-api.md`) and `/metrics`.
//!
//! Errors come back as `{"error": "..."}` with a status that says who is at
//! fault: 400 bad input, 404 unknown volume or bitmap, 409 name taken,
//! 500 the server's own failure.

use crate::config::parse_size;
use crate::ServerState;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use bytes::{Bytes, BytesMut};
use ferry_storage::{BitmapInfo, CreateOptions, StorageError, Volume, VolumeMeta, ZeroMode};
use futures_util::StreamExt;
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// An error answer of the admin API.
#[derive(Debug)]
pub struct ApiError(StatusCode, String);

impl From<StorageError> for ApiError {
    fn from(e: StorageError) -> Self {
        let code = match &e {
            StorageError::NotFound(_) | StorageError::BitmapNotFound(_) => StatusCode::NOT_FOUND,
            StorageError::Exists(_)
            | StorageError::BitmapExists(_)
            | StorageError::Moved { .. } => StatusCode::CONFLICT,
            StorageError::InvalidName(_)
            | StorageError::Invalid(_)
            | StorageError::OutOfRange { .. }
            | StorageError::ReadOnly(_) => StatusCode::BAD_REQUEST,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        ApiError(code, e.to_string())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.0, Json(serde_json::json!({ "error": self.1 }))).into_response()
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

/// A size given as a number of bytes or a string such as "10G".
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum SizeArg {
    Bytes(u64),
    Text(String),
}

impl SizeArg {
    fn bytes(&self) -> Result<u64, ApiError> {
        match self {
            SizeArg::Bytes(b) => Ok(*b),
            SizeArg::Text(t) => parse_size(t).map_err(|e| bad(e.to_string())),
        }
    }
}

#[derive(Debug, Deserialize)]
pub struct CreateRequest {
    pub name: String,
    pub size: Option<SizeArg>,
    #[serde(default)]
    pub block_size: Option<u32>,
    #[serde(default)]
    pub preallocate: bool,
    #[serde(default)]
    pub path: Option<std::path::PathBuf>,
    #[serde(default)]
    pub read_only: bool,
}

#[derive(Debug, Deserialize)]
pub struct ResizeRequest {
    pub size: SizeArg,
    #[serde(default)]
    pub allow_shrink: bool,
}

#[derive(Debug, Deserialize)]
pub struct BitmapRequest {
    pub name: String,
    #[serde(default = "default_granularity")]
    pub granularity: u32,
    #[serde(default)]
    pub persistent: bool,
}

fn default_granularity() -> u32 {
    65536
}

/// A volume as the API shows it.
#[derive(Debug, Serialize, Deserialize)]
pub struct VolumeView {
    #[serde(flatten)]
    pub meta: VolumeMeta,
    pub allocated_bytes: u64,
    pub data_path: std::path::PathBuf,
    pub direct_io: bool,
    pub dirty_bitmaps: Vec<BitmapView>,
}

/// A bitmap as the API shows it.
#[derive(Debug, Serialize, Deserialize)]
pub struct BitmapView {
    pub name: String,
    pub granularity: u32,
    pub persistent: bool,
    pub dirty_bytes: u64,
    pub dirty_chunks: u64,
}

impl From<BitmapInfo> for BitmapView {
    fn from(b: BitmapInfo) -> Self {
        BitmapView {
            name: b.name,
            granularity: b.granularity,
            persistent: b.persistent,
            dirty_bytes: b.dirty_bytes,
            dirty_chunks: b.dirty_chunks,
        }
    }
}

fn view(v: &Volume) -> VolumeView {
    VolumeView {
        meta: v.meta(),
        allocated_bytes: v.allocated_bytes(),
        data_path: v.data_path().to_path_buf(),
        direct_io: v.direct_io(),
        dirty_bitmaps: v.bitmaps().into_iter().map(Into::into).collect(),
    }
}

/// What the daemon is and where it listens.
#[derive(Debug, Serialize, Deserialize)]
pub struct ServerView {
    pub version: String,
    pub pool: std::path::PathBuf,
    pub nbd: Option<String>,
    pub admin: Option<String>,
    #[serde(default)]
    pub migration: Option<String>,
    /// iSCSI portals, in portal-group order.
    #[serde(default)]
    pub iscsi: Vec<String>,
    #[serde(default)]
    pub iscsi_base_iqn: String,
    /// SHA-256 of this daemon's migration certificate, once it has one.
    #[serde(default)]
    pub cert_fingerprint: Option<String>,
}

type St = State<Arc<ServerState>>;
type ApiResult<T> = Result<T, ApiError>;

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
        .route("/v1/volumes/:name/migrate", post(migrate))
        .route("/v1/migrations", get(list_migrations))
        .route(
            "/v1/migrations/:id",
            get(get_migration).delete(cancel_migration),
        )
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
        cert_fingerprint: crate::migration::tls::CertStore::new(s.pool.root())
            .own_cert()
            .ok()
            .map(|c| crate::migration::tls::fingerprint(&c)),
    })
}

async fn list(State(s): St) -> Json<Vec<VolumeView>> {
    Json(s.pool.list().iter().map(|v| view(v)).collect())
}

async fn create(
    State(s): St,
    Json(r): Json<CreateRequest>,
) -> ApiResult<(StatusCode, Json<VolumeView>)> {
    let size = match &r.size {
        Some(sz) => sz.bytes()?,
        None if r.path.is_some() => 0,
        None => return Err(bad("size is required")),
    };
    let opts = CreateOptions {
        size,
        block_size: r.block_size.unwrap_or(512),
        preallocate: r.preallocate,
        external: r.path.clone(),
        read_only: r.read_only,
        ..CreateOptions::default()
    };
    let pool = s.pool.clone();
    let v = blocking(move || pool.create(&r.name, &opts)).await?;
    tracing::info!(volume = %v.name(), size = v.size(), "volume created");
    Ok((StatusCode::CREATED, Json(view(&v))))
}

async fn info(State(s): St, Path(name): Path<String>) -> ApiResult<Json<VolumeView>> {
    let v = s.pool.get(&name)?;
    Ok(Json(view(&v)))
}

async fn delete(State(s): St, Path(name): Path<String>) -> ApiResult<StatusCode> {
    let pool = s.pool.clone();
    let n = name.clone();
    blocking(move || pool.delete(&n)).await?;
    s.index.remove(&name);
    tracing::info!(volume = %name, "volume deleted");
    Ok(StatusCode::NO_CONTENT)
}

async fn resize(
    State(s): St,
    Path(name): Path<String>,
    Json(r): Json<ResizeRequest>,
) -> ApiResult<Json<VolumeView>> {
    let v = s.pool.get(&name)?;
    let size = r.size.bytes()?;
    let v2 = v.clone();
    blocking(move || v2.resize(size, r.allow_shrink)).await?;
    Ok(Json(view(&v)))
}

const IO_CHUNK: usize = 1 << 20;

/// Stream a raw image into the volume from offset 0. All-zero chunks become
/// holes (or zeroed ranges) instead of written data.
async fn import(
    State(s): St,
    Path(name): Path<String>,
    body: Body,
) -> ApiResult<Json<serde_json::Value>> {
    let v = s.pool.get(&name)?;
    let size = v.size();
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
    blocking(move || v2.flush()).await?;
    // The imported content is what other volumes will be rebuilt from.
    let (st, v2) = (s.clone(), v.clone());
    tokio::task::spawn_blocking(move || match crate::indexer::rebuild_volume(&st, &v2) {
        Ok(r) => tracing::info!(volume = %v2.name(), blocks = r.blocks, "re-indexed after import"),
        Err(e) => tracing::warn!(volume = %v2.name(), error = %e, "indexing after import failed"),
    });
    Ok(Json(
        serde_json::json!({ "bytes": offset, "written": written, "zeroed": zeroed }),
    ))
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
            let n = (size - off).min(IO_CHUNK as u64) as usize;
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
            .map(Into::into)
            .collect(),
    ))
}

async fn create_bitmap(
    State(s): St,
    Path(name): Path<String>,
    Json(r): Json<BitmapRequest>,
) -> ApiResult<(StatusCode, Json<BitmapView>)> {
    let v = s.pool.get(&name)?;
    let b = v.create_bitmap(&r.name, r.granularity, r.persistent)?;
    Ok((StatusCode::CREATED, Json(b.info().into())))
}

async fn get_bitmap(
    State(s): St,
    Path((name, bm)): Path<(String, String)>,
) -> ApiResult<Json<BitmapView>> {
    Ok(Json(s.pool.get(&name)?.bitmap(&bm)?.info().into()))
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
    b.clear();
    Ok(Json(b.info().into()))
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

#[derive(Debug, Deserialize, Default)]
pub struct RebuildRequest {
    /// One volume; all volumes when absent.
    #[serde(default)]
    pub volume: Option<String>,
}

/// One volume's rebuild result.
#[derive(Debug, Serialize, Deserialize)]
pub struct RebuildReport {
    pub volume: String,
    pub bytes: u64,
    pub read_bytes: u64,
    pub blocks: u64,
    pub zero_blocks: u64,
    pub seconds: f64,
    pub mb_per_s: f64,
}

async fn index_status(State(s): St) -> Json<ferry_index::IndexStatus> {
    Json(s.index.status())
}

async fn index_rebuild(
    State(s): St,
    body: Option<Json<RebuildRequest>>,
) -> ApiResult<Json<Vec<RebuildReport>>> {
    let req = body.map(|b| b.0).unwrap_or_default();
    let vols = match &req.volume {
        Some(n) => vec![s.pool.get(n)?],
        None => s.pool.list(),
    };
    let state = s.clone();
    let out = blocking(move || {
        vols.iter()
            .map(|v| {
                let name = v.name();
                let st = crate::indexer::rebuild_volume(&state, v)?;
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

/// `POST /v1/volumes/NAME/migrate`: what to migrate where, and how.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MigrateBody {
    /// `HOST:PORT` of the destination's migration listener.
    pub to: String,
    #[serde(default)]
    pub plaintext: bool,
    /// Target for the final pause, in milliseconds (default 100).
    pub max_downtime_ms: Option<u64>,
    /// Link cap, bytes per second or a size per second ("12M").
    pub bwlimit: Option<SizeArg>,
    pub max_rounds: Option<u32>,
    /// false: send every non-zero chunk (the full-copy baseline).
    pub dedup: Option<bool>,
    pub compress: Option<bool>,
    /// Keep resuming after link failures this long (default 60 s).
    pub retry_for_s: Option<u64>,
}

async fn migrate(
    State(s): St,
    Path(name): Path<String>,
    Json(b): Json<MigrateBody>,
) -> ApiResult<(StatusCode, Json<serde_json::Value>)> {
    use crate::migration::source::{start, MigrateRequest};
    let d = MigrateRequest::default();
    let req = MigrateRequest {
        volume: name,
        to: b.to,
        plaintext: b.plaintext,
        max_downtime: b
            .max_downtime_ms
            .map_or(d.max_downtime, std::time::Duration::from_millis),
        bwlimit: match &b.bwlimit {
            Some(x) => x.bytes()?,
            None => 0,
        },
        max_rounds: b.max_rounds.unwrap_or(d.max_rounds),
        dedup: b.dedup.unwrap_or(true),
        compress: b.compress.unwrap_or(true),
        retry_for: b
            .retry_for_s
            .map_or(d.retry_for, std::time::Duration::from_secs),
    };
    let run = start(s.clone(), req).map_err(|e| match e {
        crate::migration::MigrationError::Storage(se) => ApiError::from(se),
        e => bad(e.to_string()),
    })?;
    Ok((StatusCode::ACCEPTED, Json(run.status())))
}

async fn list_migrations(State(s): St) -> Json<Vec<serde_json::Value>> {
    Json(s.migrations.list().iter().map(|r| r.status()).collect())
}

async fn get_migration(State(s): St, Path(id): Path<String>) -> ApiResult<Json<serde_json::Value>> {
    s.migrations
        .get(&id)
        .map(|r| Json(r.status()))
        .ok_or_else(|| ApiError(StatusCode::NOT_FOUND, format!("no migration {id}")))
}

async fn cancel_migration(
    State(s): St,
    Path(id): Path<String>,
) -> ApiResult<Json<serde_json::Value>> {
    let r = s
        .migrations
        .get(&id)
        .ok_or_else(|| ApiError(StatusCode::NOT_FOUND, format!("no migration {id}")))?;
    r.cancel.cancel();
    Ok(Json(r.status()))
}
