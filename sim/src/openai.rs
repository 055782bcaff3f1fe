//! OpenAI / SGLang response shapes: complete JSON answers for chat, completions and
//! `/generate`, and the SSE stream that turns scheduler progress into SGLang-framed chunks.

use std::collections::VecDeque;
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::api::{ApiError, Job, Kind};
use crate::app::InflightGuard;
use crate::sched::Progress;
use crate::tokenizer::{self, Finish};

/// Per-job state kept while answering.
pub(crate) struct JobState {
    pub(crate) prompt_tokens: usize,
    pub(crate) output: Vec<u32>,
    pub(crate) finish: Finish,
    pub(crate) cached: usize,
    pub(crate) generated: usize,
    pub(crate) finished: bool,
    pub(crate) role_sent: bool,
}

impl JobState {
    pub(crate) fn new(j: Job) -> Self {
        JobState {
            prompt_tokens: j.prompt.len(),
            output: j.output,
            finish: j.finish,
            cached: 0,
            generated: 0,
            finished: false,
            role_sent: false,
        }
    }

    fn text(&self, from: usize, to: usize) -> String {
        tokenizer::detokenize(&self.output[from.min(self.output.len())..to.min(self.output.len())])
    }

    fn finish_reason(&self) -> &'static str {
        match self.finish {
            Finish::Stop => "stop",
            Finish::Length => "length",
        }
    }

    fn matched_stop(&self) -> Value {
        match self.finish {
            Finish::Stop => json!(tokenizer::EOT),
            Finish::Length => Value::Null,
        }
    }

    fn meta_finish(&self) -> Value {
        meta_finish(self.finish, self.generated)
    }
}

/// `/generate`'s `meta_info.finish_reason`.
fn meta_finish(finish: Finish, generated: usize) -> Value {
    match finish {
        Finish::Stop => json!({"type": "stop", "matched": tokenizer::EOT}),
        Finish::Length => json!({"type": "length", "length": generated}),
    }
}

/// Shared response metadata.
pub(crate) struct Meta {
    pub(crate) kind: Kind,
    pub(crate) id: String,
    pub(crate) created: u64,
    pub(crate) model: String,
    pub(crate) include_usage: bool,
    pub(crate) batch: bool,
    pub(crate) start: Instant,
}

fn usage(jobs: &[JobState]) -> Value {
    let p: usize = jobs.iter().map(|j| j.prompt_tokens).sum();
    let c: usize = jobs.iter().map(|j| j.generated).sum();
    let cached: usize = jobs.iter().map(|j| j.cached).sum();
    json!({
        "prompt_tokens": p,
        "total_tokens": p + c,
        "completion_tokens": c,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

/// SSE body: turns scheduler progress into SGLang-framed chunks.
pub struct SseStream {
    pub(crate) rx: mpsc::UnboundedReceiver<Progress>,
    pub(crate) meta: Meta,
    pub(crate) jobs: Vec<JobState>,
    pub(crate) pending: VecDeque<Bytes>,
    pub(crate) done: bool,
    pub(crate) _guard: InflightGuard,
}

impl SseStream {
    fn chunk(&self, choices: Value) -> Value {
        let object = match self.meta.kind {
            Kind::Chat => "chat.completion.chunk",
            _ => "text_completion",
        };
        json!({
            "id": self.meta.id,
            "object": object,
            "created": self.meta.created,
            "model": self.meta.model,
            "choices": choices,
        })
    }

    pub(crate) fn on_progress(&mut self, p: Progress) {
        let Some(j) = self.jobs.get(p.index) else {
            return;
        };
        let prev = j.generated;
        let new_text = j.text(prev, p.generated);
        let i = p.index;
        let mut frames = Vec::new();
        match self.meta.kind {
            Kind::Chat => {
                if !j.role_sent {
                    frames.push(self.chunk(json!([{
                        "index": i, "delta": {"role": "assistant", "content": ""},
                        "logprobs": null, "finish_reason": null}])));
                }
                if !new_text.is_empty() {
                    frames.push(self.chunk(json!([{
                        "index": i, "delta": {"content": new_text},
                        "logprobs": null, "finish_reason": null}])));
                }
                if p.finished {
                    frames.push(self.chunk(json!([{
                        "index": i, "delta": {}, "logprobs": null,
                        "finish_reason": j.finish_reason(), "matched_stop": j.matched_stop()}])));
                }
            }
            Kind::Completion => {
                if !new_text.is_empty() || p.finished {
                    let (fr, ms) = if p.finished {
                        (json!(j.finish_reason()), j.matched_stop())
                    } else {
                        (Value::Null, Value::Null)
                    };
                    frames.push(self.chunk(json!([{
                        "index": i, "text": new_text, "logprobs": null,
                        "finish_reason": fr, "matched_stop": ms}])));
                }
            }
            Kind::Generate => {
                let mut v = json!({
                    "text": j.text(0, p.generated),
                    "output_ids": &j.output[..p.generated.min(j.output.len())],
                    "meta_info": {
                        "id": self.meta.id,
                        "finish_reason": Value::Null,
                        "prompt_tokens": j.prompt_tokens,
                        "completion_tokens": p.generated,
                        "cached_tokens": p.cached,
                        "e2e_latency": self.meta.start.elapsed().as_secs_f64(),
                    }
                });
                if p.finished {
                    v["meta_info"]["finish_reason"] = meta_finish(j.finish, p.generated);
                }
                if self.meta.batch {
                    v["index"] = json!(i);
                }
                frames.push(v);
            }
        }
        for f in &frames {
            self.pending.push_back(sse(f));
        }
        if let Some(j) = self.jobs.get_mut(i) {
            j.role_sent = true;
            j.generated = p.generated;
            j.cached = p.cached;
            j.finished = p.finished;
        }
        if self.jobs.iter().all(|j| j.finished) {
            self.finish_stream();
        }
    }

    fn finish_stream(&mut self) {
        if self.done {
            return;
        }
        self.done = true;
        if self.meta.include_usage && self.meta.kind != Kind::Generate {
            let u = usage(&self.jobs);
            let mut c = self.chunk(json!([]));
            c["usage"] = u;
            self.pending.push_back(sse(&c));
        }
        self.pending
            .push_back(Bytes::from_static(b"data: [DONE]\n\n"));
    }

    pub(crate) fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Option<Bytes>> {
        loop {
            if let Some(b) = self.pending.pop_front() {
                return Poll::Ready(Some(b));
            }
            if self.done {
                return Poll::Ready(None);
            }
            match self.rx.poll_recv(cx) {
                Poll::Ready(Some(p)) => self.on_progress(p),
                Poll::Ready(None) => {
                    // scheduler went away mid-stream: report an error frame and end
                    let e = ApiError::internal("generation aborted");
                    self.pending
                        .push_back(Bytes::from(format!("data: {}\n\n", e.body())));
                    self.finish_stream();
                }
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

pub(crate) fn full_response(meta: &Meta, jobs: &[JobState]) -> Value {
    match meta.kind {
        Kind::Chat => {
            let choices: Vec<Value> = jobs
                .iter()
                .enumerate()
                .map(|(i, j)| {
                    json!({
                        "index": i,
                        "message": {"role": "assistant", "content": j.text(0, j.generated),
                                    "reasoning_content": null, "tool_calls": null},
                        "logprobs": null,
                        "finish_reason": j.finish_reason(),
                        "matched_stop": j.matched_stop(),
                    })
                })
                .collect();
            json!({"id": meta.id, "object": "chat.completion", "created": meta.created,
                   "model": meta.model, "choices": choices, "usage": usage(jobs)})
        }
        Kind::Completion => {
            let choices: Vec<Value> = jobs
                .iter()
                .enumerate()
                .map(|(i, j)| {
                    json!({"index": i, "text": j.text(0, j.generated), "logprobs": null,
                           "finish_reason": j.finish_reason(), "matched_stop": j.matched_stop()})
                })
                .collect();
            json!({"id": meta.id, "object": "text_completion", "created": meta.created,
                   "model": meta.model, "choices": choices, "usage": usage(jobs)})
        }
        Kind::Generate => {
            let e2e = meta.start.elapsed().as_secs_f64();
            let items: Vec<Value> = jobs
                .iter()
                .enumerate()
                .map(|(i, j)| {
                    json!({
                        "text": j.text(0, j.generated),
                        "output_ids": &j.output[..j.generated.min(j.output.len())],
                        "meta_info": {
                            "id": if meta.batch { format!("{}-{i}", meta.id) } else { meta.id.clone() },
                            "finish_reason": j.meta_finish(),
                            "prompt_tokens": j.prompt_tokens,
                            "completion_tokens": j.generated,
                            "cached_tokens": j.cached,
                            "e2e_latency": e2e,
                        }
                    })
                })
                .collect();
            if meta.batch {
                Value::Array(items)
            } else {
                items.into_iter().next().unwrap_or(Value::Null)
            }
        }
    }
}
