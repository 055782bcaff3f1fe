//! Load endpoints a router polls: `GET /get_load` (older SGLang) and `GET /v1/loads` (newer).

use std::fmt::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

use hyper::StatusCode;
use serde_json::{json, Value};

use crate::app::App;
use crate::response::{detail, json_resp, respond, Resp};

/// Seconds since the Unix epoch as a float (SGLang's `time.time()`).
fn unix_now_f64() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// `YYYY-MM-DDTHH:MM:SS.ffffff+00:00`, i.e. Python's `datetime.now(timezone.utc).isoformat()`.
fn iso8601_utc(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs();
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    // civil_from_days (H. Hinnant): days since 1970-01-01 -> proleptic Gregorian date
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:06}+00:00",
        rem / 3600,
        rem / 60 % 60,
        rem % 60,
        d.subsec_micros()
    )
}

fn round_to(x: f64, digits: i32) -> f64 {
    let m = 10f64.powi(digits);
    (x * m).round() / m
}

/// Minimal percent-decoding for query values (`include=core%2Cqueues`).
fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        match b[i] {
            b'%' if i + 2 < b.len() => match (hex(b[i + 1]), hex(b[i + 2])) {
                (Some(h), Some(l)) => {
                    out.push((h * 16 + l) as u8);
                    i += 3;
                    continue;
                }
                _ => out.push(b'%'),
            },
            b'+' => out.push(b' '),
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `GET /get_load`: `[{"dp_rank":0,"num_reqs":N,"num_waiting_reqs":N,"num_tokens":N}]`.
pub(crate) fn get_load(app: &App) -> Resp {
    let (run, wait, toks) = app.load();
    json_resp(
        app,
        StatusCode::OK,
        &json!([{"dp_rank": 0, "num_reqs": run + wait, "num_waiting_reqs": wait,
                 "num_tokens": toks}]),
    )
}

/// Sections `include=` accepts (SGLang's `LoadSnapshot.VALID_SECTIONS`).
const LOAD_SECTIONS: [&str; 7] = ["all", "core", "disagg", "lora", "memory", "queues", "spec"];

/// `GET /v1/loads[?dp_rank=N][&include=core,queues][&format=prometheus]`, newer SGLang's load
/// endpoint. Matched against SGLang's `python/sglang/srt/entrypoints/v1_loads.py` and
/// `managers/load_snapshot.py` (2026): top level `{"timestamp": ISO-8601 UTC string, "version",
/// "accelerator", "num_accelerators", "loads": [one object per DP rank]}`, no cross-rank
/// aggregate; each rank carries the 12 core fields in SGLang's order (`dp_rank`,
/// `num_running_reqs`, `num_waiting_reqs`, `num_waiting_uncached_tokens`, `num_used_tokens`,
/// `num_total_tokens` = used + `seqlen` of waiting requests, `max_total_num_tokens`,
/// `max_running_requests`, `token_usage` (4 decimals), `gen_throughput` (2), `cache_hit_rate`
/// (4), `utilization` (4)) plus the optional `queues` section (the sim has no memory / spec /
/// lora / disaggregation data: those sections are absent, as SGLang omits `None` sections).
/// Additions: each rank also has `timestamp` (Unix seconds, float: the snapshot time SGLang
/// keeps internally in `LoadSnapshot.timestamp`). An out-of-range `dp_rank` gives an empty
/// `loads`; an unknown section gives 400 `{"detail": ...}`; `format=prometheus` renders every
/// numeric field as a `sglang_<field>{dp_rank="0"}` gauge (`sglang_queues_<field>` for the
/// section), as SGLang's `_format_loads_prometheus`.
pub(crate) fn loads(app: &App, query: Option<&str>) -> Resp {
    let mut dp_rank: Option<String> = None;
    let mut include: Option<String> = None;
    let mut format: Option<String> = None;
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let v = percent_decode(v);
        match k {
            "dp_rank" => dp_rank = Some(v),
            "include" => include = Some(v),
            "format" => format = Some(v),
            _ => {}
        }
    }
    let dp_rank = match dp_rank.as_deref().map(|s| s.trim().parse::<i64>()) {
        None => None,
        Some(Ok(n)) => Some(n),
        Some(Err(_)) => {
            // FastAPI's answer to a query parameter that is not an int
            return json_resp(
                app,
                StatusCode::UNPROCESSABLE_ENTITY,
                &json!({"detail": [{"type": "int_parsing", "loc": ["query", "dp_rank"],
                    "msg": "Input should be a valid integer, unable to parse string as an integer",
                    "input": dp_rank}]}),
            );
        }
    };
    let sections: Option<Vec<String>> = include
        .filter(|s| !s.is_empty())
        .map(|s| s.split(',').map(|p| p.trim().to_string()).collect());
    if let Some(secs) = &sections {
        let bad: Vec<String> = secs
            .iter()
            .filter(|s| !LOAD_SECTIONS.contains(&s.as_str()))
            .map(|s| format!("'{s}'"))
            .collect();
        if !bad.is_empty() {
            let valid: Vec<String> = LOAD_SECTIONS.iter().map(|s| format!("'{s}'")).collect();
            return detail(
                app,
                StatusCode::BAD_REQUEST,
                &format!(
                    "Invalid include sections: {{{}}}. Valid options: [{}]",
                    bad.join(", "),
                    valid.join(", ")
                ),
            );
        }
    }
    let want = |name: &str| {
        sections
            .as_ref()
            .is_none_or(|s| s.iter().any(|x| x == "all" || x == name))
    };
    let now = SystemTime::now();
    let snap = app.stats.lock().map(|s| s.clone()).ok();
    let c = &app.cfg;
    let (run, wait, unc, used, waiting_toks, usage, tput, hit, retracted) = match &snap {
        Some(s) => (
            s.num_running,
            s.num_waiting,
            s.waiting_uncached_tokens,
            s.used_tokens,
            s.waiting_tokens,
            s.token_usage(),
            s.gen_throughput,
            s.cache_hit_rate,
            s.num_retracted_reqs,
        ),
        None => (0, 0, 0, 0, 0, 0.0, 0.0, 0.0, 0),
    };
    // SGLang's intended utilization (its `_calculate_utilization`): the tighter of the request
    // slots and the KV pool (at 90%); SGLang itself currently reports 0 (no SLO limit set).
    let utilization = (run as f64 / c.max_running_requests.max(1) as f64).max(usage / 0.9);
    let core: Vec<(&str, Value)> = vec![
        ("dp_rank", json!(0)),
        ("num_running_reqs", json!(run)),
        ("num_waiting_reqs", json!(wait)),
        ("num_waiting_uncached_tokens", json!(unc)),
        ("num_used_tokens", json!(used)),
        ("num_total_tokens", json!(used + waiting_toks)),
        ("max_total_num_tokens", json!(c.max_total_tokens)),
        ("max_running_requests", json!(c.max_running_requests)),
        ("token_usage", json!(round_to(usage, 4))),
        ("gen_throughput", json!(round_to(tput, 2))),
        ("cache_hit_rate", json!(round_to(hit, 4))),
        ("utilization", json!(round_to(utilization, 4))),
    ];
    let queues: Option<Vec<(&str, Value)>> = want("queues").then(|| {
        vec![
            ("waiting", json!(wait)),
            ("grammar", json!(0)),
            ("paused", json!(0)),
            // retracted since the previous stats point, as SGLang's `num_retracted_reqs`
            ("retracted", json!(retracted)),
        ]
    });
    // one data-parallel rank (0); any other rank asked for: no entries
    let ranks: usize = if dp_rank.is_none_or(|r| r == 0) { 1 } else { 0 };
    if format.as_deref() == Some("prometheus") {
        let mut out = String::new();
        if ranks > 0 {
            for (k, v) in &core[1..] {
                let _ = write!(
                    out,
                    "# TYPE sglang_{k} gauge\nsglang_{k}{{dp_rank=\"0\"}} {v}\n"
                );
            }
            for (k, v) in queues.iter().flatten() {
                let _ = write!(
                    out,
                    "# TYPE sglang_queues_{k} gauge\nsglang_queues_{k}{{dp_rank=\"0\"}} {v}\n"
                );
            }
        }
        if out.is_empty() {
            out.push('\n');
        }
        return respond(
            app,
            StatusCode::OK,
            "text/plain; version=0.0.4; charset=utf-8",
            out,
        );
    }
    let mut loads = Vec::with_capacity(ranks);
    if ranks > 0 {
        let mut m = serde_json::Map::new();
        for (k, v) in core {
            m.insert(k.to_string(), v);
        }
        m.insert("timestamp".into(), json!(unix_now_f64()));
        if let Some(q) = queues {
            let q: serde_json::Map<String, Value> =
                q.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
            m.insert("queues".into(), Value::Object(q));
        }
        loads.push(Value::Object(m));
    }
    json_resp(
        app,
        StatusCode::OK,
        &json!({
            "timestamp": iso8601_utc(now),
            "version": concat!("sglang-sim ", env!("CARGO_PKG_VERSION")),
            "accelerator": null,
            "num_accelerators": 1,
            "loads": loads,
        }),
    )
}
