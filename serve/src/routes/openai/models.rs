//! `GET /v1/models` and `/v1/models/{model}`: the one served model. SGLang's tools poll
//! `/v1/models` for readiness, and the router only exists once the model is loaded. The id may
//! hold slashes (`/v1/models/Qwen/Qwen3-8B`), as SGLang's `{model:path}` route takes it.

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use crate::state::AppState;

fn card(state: &AppState) -> Value {
    let name = &state.config.served_model_name;
    json!({
        "id": name,
        "object": "model",
        "created": state.started_unix,
        "owned_by": "sglang",
        "root": name,
        "parent": null,
        "max_model_len": state.model.lower.context_length,
    })
}

pub async fn list(State(state): State<AppState>) -> Json<Value> {
    Json(json!({"object": "list", "data": [card(&state)]}))
}

pub async fn one(State(state): State<AppState>, Path(model): Path<String>) -> Response {
    if model == state.config.served_model_name {
        return Json(card(&state)).into_response();
    }
    (
        StatusCode::NOT_FOUND,
        Json(json!({"error": {
            "message": format!("The model '{model}' does not exist"),
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }})),
    )
        .into_response()
}
