//! The agent's control API (HTTP/JSON, `ferry_api::host` types): list,
//! attach and detach the volumes it forwards. It decides what the host's
//! guests can reach, so it is served through `ferry_trust::api`: plaintext
//! only on loopback, TLS with pinned client certificates beyond it (`ferry
//! host` with a state directory), and only operators change anything.
//!
//! | method and path | body | answer |
//! |---|---|---|
//! | `GET /v1/volumes` | | `[AttachedVolume]` |
//! | `POST /v1/volumes` | `AttachRequest` | 201 `AttachedVolume`; 409 attached already; 502 no server answered |
//! | `DELETE /v1/volumes/{volume}` | | 204; 404 not attached |

use crate::{Agent, HostError, Upstream};
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get};
use axum::{Json, Router};
use ferry_api::{AttachRequest, AttachedVolume, ErrorBody};
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

fn view(u: &Upstream) -> AttachedVolume {
    let (switches, reconnects, retried) = u.stats();
    AttachedVolume {
        volume: u.volume().to_string(),
        server: u.server(),
        size: u.details().size,
        switches,
        reconnects,
        retried,
    }
}

struct ApiError(StatusCode, String);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.0, Json(ErrorBody { error: self.1 })).into_response()
    }
}

impl From<HostError> for ApiError {
    fn from(e: HostError) -> Self {
        let code = match &e {
            HostError::Attached(_) => StatusCode::CONFLICT,
            HostError::Listen { .. } => StatusCode::INTERNAL_SERVER_ERROR,
            HostError::Connect { .. } | HostError::Unreachable { .. } => StatusCode::BAD_GATEWAY,
        };
        ApiError(code, e.to_string())
    }
}

type St = State<Arc<Agent>>;

pub fn router(agent: Arc<Agent>) -> Router {
    Router::new()
        .route("/v1/volumes", get(list).post(attach))
        .route("/v1/volumes/:volume", delete(detach))
        .with_state(agent)
}

async fn list(State(a): St) -> Json<Vec<AttachedVolume>> {
    Json(a.list().iter().map(|u| view(u)).collect())
}

async fn attach(
    State(a): St,
    body: Result<Json<AttachRequest>, axum::extract::rejection::JsonRejection>,
) -> Result<(StatusCode, Json<AttachedVolume>), ApiError> {
    let Json(r) = body.map_err(|e| ApiError(StatusCode::BAD_REQUEST, e.body_text()))?;
    let up = a.attach(&r.server, &r.volume).await?;
    Ok((StatusCode::CREATED, Json(view(&up))))
}

async fn detach(State(a): St, Path(volume): Path<String>) -> Result<StatusCode, ApiError> {
    a.detach(&volume)
        .map(|_| StatusCode::NO_CONTENT)
        .ok_or_else(|| {
            ApiError(
                StatusCode::NOT_FOUND,
                format!("volume {volume} is not attached"),
            )
        })
}

/// Serve the control API until `shutdown`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    agent: Arc<Agent>,
    shutdown: CancellationToken,
) {
    let sec = ferry_trust::api::ApiSecurity {
        name: "host control API",
        store: None,
        insecure_plaintext: false,
        access: ferry_trust::api::operator_writes,
        limits: ferry_trust::api::API_LIMITS,
    };
    match ferry_trust::api::ApiListener::new(listener, sec) {
        Ok(api) => ferry_trust::api::serve(api, router(agent), shutdown).await,
        Err(e) => tracing::error!(error = %e, "control API not served"),
    }
}
