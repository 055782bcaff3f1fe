//! The response body (a complete buffer or an SSE stream) and the reply helpers every handler
//! uses; each reply carries the worker's `x-worker-id` header.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use hyper::body::{Body, Frame, SizeHint};
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::{Response, StatusCode};
use serde_json::{json, Value};

use crate::api::ApiError;
use crate::app::App;
use crate::openai::SseStream;

/// Response body: a complete buffer or an SSE stream fed by the scheduler.
pub enum SimBody {
    Full(Option<Bytes>),
    Sse(Box<SseStream>),
}

impl Body for SimBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match self.get_mut() {
            SimBody::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            SimBody::Sse(s) => s.poll_next(cx).map(|o| o.map(|b| Ok(Frame::data(b)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self, SimBody::Full(None))
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            SimBody::Full(Some(b)) => SizeHint::with_exact(b.len() as u64),
            SimBody::Full(None) => SizeHint::with_exact(0),
            SimBody::Sse(_) => SizeHint::default(),
        }
    }
}

pub type Resp = Response<SimBody>;

pub(crate) fn respond(
    app: &App,
    status: StatusCode,
    ctype: &'static str,
    body: impl Into<Bytes>,
) -> Resp {
    let mut r = Response::new(SimBody::Full(Some(body.into())));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(ctype));
    r.headers_mut()
        .insert("x-worker-id", app.worker_header.clone());
    r
}

pub(crate) fn json_resp(app: &App, status: StatusCode, v: &Value) -> Resp {
    respond(app, status, "application/json", v.to_string())
}

pub(crate) fn error_resp(app: &App, e: &ApiError) -> Resp {
    let status = StatusCode::from_u16(e.code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    respond(app, status, "application/json", e.body())
}

pub(crate) fn detail(app: &App, status: StatusCode, msg: &str) -> Resp {
    json_resp(app, status, &json!({ "detail": msg }))
}
