//! Informational and admin endpoints: `/get_server_info` (`/server_info`) and `/flush_cache`.

use std::sync::Arc;

use hyper::StatusCode;
use serde_json::{json, Value};
use tokio::sync::oneshot;

use crate::app::App;
use crate::response::{respond, Resp};
use crate::sched::Cmd;

pub(crate) async fn flush_cache(app: Arc<App>) -> Resp {
    let (tx, rx) = oneshot::channel();
    let ok = app.sched.send(Cmd::Flush(tx)).is_ok() && rx.await.unwrap_or(false);
    if ok {
        respond(
            &app,
            StatusCode::OK,
            "text/plain",
            "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, the operation will not be performed.)\n",
        )
    } else {
        respond(
            &app,
            StatusCode::BAD_REQUEST,
            "text/plain",
            "Cache not flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, the operation will not be performed.)\n",
        )
    }
}

pub(crate) fn server_info(app: &App) -> Value {
    let c = &app.cfg;
    let s = app.stats.lock().map(|s| s.clone()).ok();
    json!({
        "model_path": c.model,
        "tokenizer_path": c.model,
        "served_model_name": c.model,
        "host": c.host,
        "port": c.port,
        "worker_id": c.worker_id,
        "max_total_num_tokens": c.max_total_tokens,
        "max_running_requests": c.max_running_requests,
        "max_prefill_tokens": c.max_prefill_tokens,
        "context_length": c.context_length,
        "chunked_prefill_size": c.chunked_prefill_size,
        "enable_mixed_chunk": c.enable_mixed_chunk,
        "max_consecutive_prefill_batches": c.max_consecutive_prefill_batches,
        "schedule_conservativeness": c.schedule_conservativeness,
        "schedule_policy": "fcfs",
        "enable_metrics": true,
        "enable_cache_report": true,
        "disable_radix_cache": false,
        "dp_size": 1,
        "disaggregation_mode": c.disaggregation_mode.as_str(),
        "disaggregation_bootstrap_port": c.disaggregation_bootstrap_port,
        "tp_size": 1,
        "version": concat!("sglang-sim ", env!("CARGO_PKG_VERSION")),
        "simulator": {
            "prefill_tokens_per_sec": c.prefill_tokens_per_sec,
            "prefill_context_per_1k_tokens": c.prefill_context_per_1k_tokens,
            "v1_loads": c.v1_loads,
            "prefill_overhead_ms": c.prefill_overhead_ms,
            "decode_base_ms": c.decode_base_ms,
            "decode_batch_factor": c.decode_batch_factor,
            "decode_kv_ms_per_1k_tokens": c.decode_kv_ms_per_1k_tokens,
            "time_scale": c.time_scale,
            "fail_rate": c.fail_rate,
            "slow_ms": c.slow_ms,
            "seed": c.seed,
            "cache_tokens": s.as_ref().map(|s| s.cache_tokens),
            "evictable_tokens": s.as_ref().map(|s| s.evictable_tokens),
            "new_token_ratio": s.as_ref().map(|s| s.new_token_ratio),
            "retractions_total": s.as_ref().map(|s| s.retractions_total),
        },
        "internal_states": [{
            "last_gen_throughput": s.as_ref().map(|s| s.gen_throughput).unwrap_or(0.0),
            "load": s.as_ref().map(|s| s.used_tokens).unwrap_or(0),
        }],
    })
}
