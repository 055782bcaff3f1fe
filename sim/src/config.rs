//! Command-line configuration. Defaults describe a Llama-3-8B-class model on one H200
//! (see `sim/README.md` for where the numbers come from).

use std::fmt::Write as _;

/// `--disaggregation-mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Not disaggregated (SGLang's `null`): bootstrap fields are ignored.
    Null,
    Prefill,
    Decode,
}

impl Mode {
    pub fn parse(s: &str) -> Result<Mode, String> {
        match s {
            "null" => Ok(Mode::Null),
            "prefill" => Ok(Mode::Prefill),
            "decode" => Ok(Mode::Decode),
            _ => Err(format!(
                "invalid value for --disaggregation-mode: {s:?} (null, prefill or decode)"
            )),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Null => "null",
            Mode::Prefill => "prefill",
            Mode::Decode => "decode",
        }
    }
}

/// Simulator settings.
#[derive(Debug, Clone)]
pub struct Config {
    pub host: String,
    pub port: u16,
    pub model: String,
    pub worker_id: String,
    /// KV cache capacity in tokens (`max_total_num_tokens`).
    pub max_total_tokens: usize,
    pub max_running_requests: usize,
    /// Upper bound of new (uncached) prompt tokens in one prefill batch.
    pub max_prefill_tokens: usize,
    pub context_length: usize,
    /// Prefill rate of new tokens with no context before them (the zero-context rate).
    pub prefill_tokens_per_sec: f64,
    /// Attention to the context makes each new token dearer: a new token attending to `c`
    /// tokens already in the KV costs `(1 + prefill_context_per_1k_tokens * c / 1000)` times
    /// its zero-context cost (fit to the H200 table in `sim/README.md`).
    pub prefill_context_per_1k_tokens: f64,
    /// Fixed cost of one prefill forward pass (ms).
    pub prefill_overhead_ms: f64,
    /// Decode step at batch size 1 (ms).
    pub decode_base_ms: f64,
    /// Relative step-time growth per extra running request.
    pub decode_batch_factor: f64,
    /// Decode step time per 1000 tokens of KV the step reads (every running request's prompt
    /// + generated tokens): attention is memory-bound.
    pub decode_kv_ms_per_1k_tokens: f64,
    /// `--chunked-prefill-size`: at most this many new prompt tokens per prefill batch; a longer
    /// uncached prompt is prefilled in chunks over several batches. `<= 0` disables chunking.
    pub chunked_prefill_size: i64,
    /// `--enable-mixed-chunk`: the running batch decodes one token inside each prefill batch.
    pub enable_mixed_chunk: bool,
    /// `--max-consecutive-prefill-batches`: after this many prefill batches in a row, run one
    /// decode step if requests are running (0 = prefill always first, SGLang's default).
    pub max_consecutive_prefill_batches: usize,
    /// `--schedule-conservativeness`: scales the initial `new_token_ratio` (0.7 x this, max 1).
    pub schedule_conservativeness: f64,
    pub default_max_tokens: usize,
    pub time_scale: f64,
    pub fail_rate: f64,
    pub seed: u64,
    pub slow_ms: u64,
    pub threads: usize,
    pub drain_timeout_s: f64,
    /// `--disaggregation-mode`: prefill/decode disaggregation role.
    pub disaggregation_mode: Mode,
    /// `--disaggregation-bootstrap-port`: the prefill worker's bootstrap server (0 = ephemeral).
    pub disaggregation_bootstrap_port: u16,
    /// How long a decode worker waits for a room's KV (SGLang: `SGLANG_DISAGGREGATION_WAITING_TIMEOUT`);
    /// also how long a prefill worker keeps a room nobody fetched.
    pub disaggregation_timeout_s: f64,
    /// Serve newer SGLang's `GET /v1/loads`; `--no-v1-loads` answers 404 there, as older SGLang
    /// (only `/get_load`, capacity in `/get_server_info`).
    pub v1_loads: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            host: "127.0.0.1".into(),
            port: 30000,
            model: "llama-3-8b".into(),
            worker_id: String::new(),
            max_total_tokens: 800_000,
            max_running_requests: 256,
            max_prefill_tokens: 16_384,
            context_length: 8192,
            prefill_tokens_per_sec: 30_000.0,
            prefill_context_per_1k_tokens: PREFILL_CONTEXT_PER_1K_TOKENS,
            prefill_overhead_ms: 3.0,
            decode_base_ms: 8.0,
            decode_batch_factor: 0.008,
            decode_kv_ms_per_1k_tokens: 0.035,
            chunked_prefill_size: 8192,
            enable_mixed_chunk: false,
            max_consecutive_prefill_batches: 0,
            schedule_conservativeness: 1.0,
            default_max_tokens: 16,
            time_scale: 1.0,
            fail_rate: 0.0,
            seed: 0,
            slow_ms: 0,
            threads: 1,
            drain_timeout_s: 60.0,
            disaggregation_mode: Mode::Null,
            disaggregation_bootstrap_port: 8998,
            disaggregation_timeout_s: 300.0,
            v1_loads: true,
        }
    }
}

/// Flags that take no value (`--flag`, or `--flag=true|false`), as SGLang's `store_true`.
const SWITCHES: &[&str] = &["--enable-mixed-chunk", "--no-v1-loads"];

/// The default context term of prefill: a least-squares fit (relative error) of
/// `time = n * a * (1 + k * c / 1000)` to the H200 table in `sim/README.md` (n new tokens on c
/// cached ones, Llama-3.1-8B shape): a = 28.9 us per token, k * a = 1.53 us per token per 1k
/// tokens of context, within 10% of every cell.
pub const PREFILL_CONTEXT_PER_1K_TOKENS: f64 = 0.053;

/// `(flag, help)` in the order printed by `--help`.
const FLAGS: &[(&str, &str)] = &[
    ("--host", "listen address"),
    ("--port", "listen port (0 = ephemeral)"),
    ("--model", "served model name"),
    (
        "--worker-id",
        "value of the x-worker-id response header (default: sim-<port>)",
    ),
    ("--max-total-tokens", "KV cache capacity in tokens"),
    ("--max-running-requests", "continuous-batching limit"),
    (
        "--max-prefill-tokens",
        "new prompt tokens per prefill batch",
    ),
    ("--context-length", "max prompt + output tokens per request"),
    (
        "--prefill-tokens-per-sec",
        "prefill speed for uncached tokens with no context before them",
    ),
    (
        "--prefill-context-per-1k-tokens",
        "a new token's prefill cost grows by this fraction per 1000 tokens of context it attends to",
    ),
    ("--prefill-overhead-ms", "fixed cost of one prefill pass"),
    ("--decode-base-ms", "decode step time at batch 1"),
    (
        "--decode-batch-factor",
        "step = base * (1 + factor * (batch - 1)) + KV term",
    ),
    (
        "--decode-kv-ms-per-1k-tokens",
        "decode step time per 1000 KV tokens read (running requests' contexts)",
    ),
    (
        "--chunked-prefill-size",
        "max new prompt tokens per prefill batch; longer prompts are chunked (<= 0: off)",
    ),
    (
        "--enable-mixed-chunk",
        "running requests decode inside prefill batches (no value, or =true/false)",
    ),
    (
        "--max-consecutive-prefill-batches",
        "force a decode step after this many prefill batches (0 = never)",
    ),
    (
        "--schedule-conservativeness",
        "scales the initial new_token_ratio (0.7 x this)",
    ),
    (
        "--default-max-tokens",
        "output length when the request names none",
    ),
    (
        "--time-scale",
        "multiplies every simulated duration (0 = no waiting)",
    ),
    ("--fail-rate", "fraction of inference requests answered 500"),
    ("--seed", "seed of the fault injection"),
    (
        "--slow-ms",
        "extra wall-clock latency per inference request",
    ),
    (
        "--threads",
        "tokio worker threads (1 = current-thread runtime)",
    ),
    (
        "--drain-timeout-s",
        "max wait for running requests after SIGTERM",
    ),
    (
        "--disaggregation-mode",
        "null, prefill or decode (PD disaggregation role)",
    ),
    (
        "--disaggregation-bootstrap-port",
        "prefill: bootstrap server port (0 = ephemeral)",
    ),
    (
        "--disaggregation-timeout-s",
        "decode: max wait for a room's KV",
    ),
    (
        "--no-v1-loads",
        "answer only /get_load, as older SGLang (/v1/loads: 404)",
    ),
];

/// Usage text with defaults.
pub fn usage() -> String {
    let d = Config::default();
    let defaults = [
        d.host.clone(),
        d.port.to_string(),
        d.model.clone(),
        "sim-<port>".into(),
        d.max_total_tokens.to_string(),
        d.max_running_requests.to_string(),
        d.max_prefill_tokens.to_string(),
        d.context_length.to_string(),
        d.prefill_tokens_per_sec.to_string(),
        d.prefill_context_per_1k_tokens.to_string(),
        d.prefill_overhead_ms.to_string(),
        d.decode_base_ms.to_string(),
        d.decode_batch_factor.to_string(),
        d.decode_kv_ms_per_1k_tokens.to_string(),
        d.chunked_prefill_size.to_string(),
        d.enable_mixed_chunk.to_string(),
        d.max_consecutive_prefill_batches.to_string(),
        d.schedule_conservativeness.to_string(),
        d.default_max_tokens.to_string(),
        d.time_scale.to_string(),
        d.fail_rate.to_string(),
        d.seed.to_string(),
        d.slow_ms.to_string(),
        d.threads.to_string(),
        d.drain_timeout_s.to_string(),
        d.disaggregation_mode.as_str().into(),
        d.disaggregation_bootstrap_port.to_string(),
        d.disaggregation_timeout_s.to_string(),
        (!d.v1_loads).to_string(),
    ];
    let mut s =
        String::from("sglang-sim: simulated SGLang worker\n\nUSAGE: sglang-sim [FLAGS]\n\n");
    for ((flag, help), def) in FLAGS.iter().zip(defaults.iter()) {
        let _ = writeln!(s, "  {flag:<34} {help} [default: {def}]");
    }
    s
}

fn num<T: std::str::FromStr>(flag: &str, v: &str) -> Result<T, String> {
    v.parse::<T>()
        .map_err(|_| format!("invalid value for {flag}: {v:?}"))
}

impl Config {
    /// Parses `--flag value` / `--flag=value` arguments (program name excluded).
    /// `Err` carries a message; `--help` yields `Err(usage())`.
    pub fn parse<I: IntoIterator<Item = String>>(args: I) -> Result<Config, String> {
        let mut c = Config::default();
        let mut worker_id_set = false;
        let mut it = args.into_iter();
        while let Some(arg) = it.next() {
            if arg == "-h" || arg == "--help" {
                return Err(usage());
            }
            let (flag, inline) = match arg.split_once('=') {
                Some((f, v)) => (f.to_string(), Some(v.to_string())),
                None => (arg.clone(), None),
            };
            if !FLAGS.iter().any(|(f, _)| *f == flag) {
                return Err(format!("unknown argument {arg:?}\n\n{}", usage()));
            }
            let v = match inline {
                Some(v) => v,
                None if SWITCHES.contains(&flag.as_str()) => "true".into(),
                None => it.next().ok_or_else(|| format!("{flag} needs a value"))?,
            };
            match flag.as_str() {
                "--host" => c.host = v,
                "--port" => c.port = num(&flag, &v)?,
                "--model" => c.model = v,
                "--worker-id" => {
                    c.worker_id = v;
                    worker_id_set = true;
                }
                "--max-total-tokens" => c.max_total_tokens = num(&flag, &v)?,
                "--max-running-requests" => c.max_running_requests = num(&flag, &v)?,
                "--max-prefill-tokens" => c.max_prefill_tokens = num(&flag, &v)?,
                "--context-length" => c.context_length = num(&flag, &v)?,
                "--prefill-tokens-per-sec" => c.prefill_tokens_per_sec = num(&flag, &v)?,
                "--prefill-context-per-1k-tokens" => {
                    c.prefill_context_per_1k_tokens = num(&flag, &v)?
                }
                "--prefill-overhead-ms" => c.prefill_overhead_ms = num(&flag, &v)?,
                "--decode-base-ms" => c.decode_base_ms = num(&flag, &v)?,
                "--decode-batch-factor" => c.decode_batch_factor = num(&flag, &v)?,
                "--decode-kv-ms-per-1k-tokens" => c.decode_kv_ms_per_1k_tokens = num(&flag, &v)?,
                "--chunked-prefill-size" => c.chunked_prefill_size = num(&flag, &v)?,
                "--enable-mixed-chunk" => c.enable_mixed_chunk = num(&flag, &v)?,
                "--max-consecutive-prefill-batches" => {
                    c.max_consecutive_prefill_batches = num(&flag, &v)?
                }
                "--schedule-conservativeness" => c.schedule_conservativeness = num(&flag, &v)?,
                "--default-max-tokens" => c.default_max_tokens = num(&flag, &v)?,
                "--time-scale" => c.time_scale = num(&flag, &v)?,
                "--fail-rate" => c.fail_rate = num(&flag, &v)?,
                "--seed" => c.seed = num(&flag, &v)?,
                "--slow-ms" => c.slow_ms = num(&flag, &v)?,
                "--threads" => c.threads = num(&flag, &v)?,
                "--drain-timeout-s" => c.drain_timeout_s = num(&flag, &v)?,
                "--disaggregation-mode" => c.disaggregation_mode = Mode::parse(&v)?,
                "--disaggregation-bootstrap-port" => {
                    c.disaggregation_bootstrap_port = num(&flag, &v)?
                }
                "--disaggregation-timeout-s" => c.disaggregation_timeout_s = num(&flag, &v)?,
                "--no-v1-loads" => c.v1_loads = !num::<bool>(&flag, &v)?,
                _ => return Err(format!("unknown argument {arg:?}")),
            }
        }
        if !worker_id_set {
            c.worker_id = format!("sim-{}", c.port);
        }
        c.validate()?;
        Ok(c)
    }

    /// Rejects settings the simulator cannot run with.
    pub fn validate(&self) -> Result<(), String> {
        if self.max_total_tokens == 0 || self.max_running_requests == 0 {
            return Err("--max-total-tokens and --max-running-requests must be > 0".into());
        }
        if self.max_prefill_tokens == 0 || self.context_length == 0 {
            return Err("--max-prefill-tokens and --context-length must be > 0".into());
        }
        if self.prefill_tokens_per_sec.is_nan() || self.prefill_tokens_per_sec <= 0.0 {
            return Err("--prefill-tokens-per-sec must be > 0".into());
        }
        for (name, v) in [
            (
                "--prefill-context-per-1k-tokens",
                self.prefill_context_per_1k_tokens,
            ),
            ("--prefill-overhead-ms", self.prefill_overhead_ms),
            ("--decode-base-ms", self.decode_base_ms),
            ("--decode-batch-factor", self.decode_batch_factor),
            (
                "--decode-kv-ms-per-1k-tokens",
                self.decode_kv_ms_per_1k_tokens,
            ),
            (
                "--schedule-conservativeness",
                self.schedule_conservativeness,
            ),
            ("--time-scale", self.time_scale),
            ("--drain-timeout-s", self.drain_timeout_s),
            ("--disaggregation-timeout-s", self.disaggregation_timeout_s),
        ] {
            if !(v >= 0.0 && v.is_finite()) {
                return Err(format!("{name} must be a finite number >= 0"));
            }
        }
        if !(0.0..=1.0).contains(&self.fail_rate) {
            return Err("--fail-rate must be within [0, 1]".into());
        }
        if self.threads == 0 {
            return Err("--threads must be >= 1".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(args: &[&str]) -> Result<Config, String> {
        Config::parse(args.iter().map(|s| s.to_string()))
    }

    #[test]
    fn parses_flags() {
        let c = p(&["--port", "1234", "--model=m", "--time-scale", "0.01"]).unwrap();
        assert_eq!(c.port, 1234);
        assert_eq!(c.model, "m");
        assert_eq!(c.worker_id, "sim-1234");
        assert_eq!(c.time_scale, 0.01);
        let c = p(&["--worker-id", "w7"]).unwrap();
        assert_eq!(c.worker_id, "w7");
    }

    #[test]
    fn rejects_bad_flags() {
        assert!(p(&["--nope", "1"]).is_err());
        assert!(p(&["--port", "x"]).is_err());
        assert!(p(&["--port"]).is_err());
        assert!(p(&["--fail-rate", "2"]).is_err());
        assert!(p(&["--time-scale", "-1"]).is_err());
        assert!(p(&["--help"]).unwrap_err().contains("--max-total-tokens"));
        assert!(p(&["--enable-mixed-chunk=maybe"]).is_err());
        assert!(p(&["--decode-kv-ms-per-1k-tokens", "-0.1"]).is_err());
    }

    #[test]
    fn scheduler_flags_and_switches() {
        let d = p(&[]).unwrap();
        assert_eq!(
            d.chunked_prefill_size, 8192,
            "SGLang's default for H100/H200-class GPUs"
        );
        assert!(!d.enable_mixed_chunk);
        assert_eq!(d.max_consecutive_prefill_batches, 0);
        assert_eq!(d.decode_kv_ms_per_1k_tokens, 0.035);
        // a switch takes no value: the next argument is a flag of its own
        let c = p(&["--enable-mixed-chunk", "--chunked-prefill-size", "-1"]).unwrap();
        assert!(c.enable_mixed_chunk);
        assert_eq!(c.chunked_prefill_size, -1);
        let c = p(&[
            "--enable-mixed-chunk=false",
            "--max-consecutive-prefill-batches=2",
        ])
        .unwrap();
        assert!(!c.enable_mixed_chunk);
        assert_eq!(c.max_consecutive_prefill_batches, 2);
        let c = p(&[
            "--decode-kv-ms-per-1k-tokens",
            "0",
            "--schedule-conservativeness",
            "0.5",
        ])
        .unwrap();
        assert_eq!(c.decode_kv_ms_per_1k_tokens, 0.0);
        assert_eq!(c.schedule_conservativeness, 0.5);
        assert!(usage().contains("--enable-mixed-chunk"));
    }

    #[test]
    fn prefill_context_and_load_api_flags() {
        let d = p(&[]).unwrap();
        assert_eq!(
            d.prefill_context_per_1k_tokens,
            PREFILL_CONTEXT_PER_1K_TOKENS
        );
        assert!(d.v1_loads);
        let c = p(&["--no-v1-loads", "--prefill-context-per-1k-tokens", "0"]).unwrap();
        assert!(!c.v1_loads);
        assert_eq!(c.prefill_context_per_1k_tokens, 0.0);
        assert!(p(&["--no-v1-loads=false"]).unwrap().v1_loads);
        assert!(p(&["--prefill-context-per-1k-tokens", "-1"]).is_err());
        assert!(p(&["--prefill-context-per-1k-tokens", "inf"]).is_err());
        let u = usage();
        assert!(u.contains("--no-v1-loads") && u.contains("[default: 0.053]"));
    }
}
