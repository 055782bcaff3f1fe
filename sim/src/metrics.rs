//! Scheduler statistics and their Prometheus text rendering (`sglang:` names).

use std::fmt::Write as _;

/// TTFT buckets (seconds), as in SGLang's metrics collector.
pub const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    15.0, 20.0, 25.0, 30.0,
];
/// Inter-token latency buckets (seconds).
pub const ITL_BUCKETS: &[f64] = &[
    0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.05, 0.075, 0.1,
    0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
];
/// End-to-end latency buckets (seconds).
pub const E2E_BUCKETS: &[f64] = &[
    0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
];

/// A cumulative histogram.
#[derive(Debug, Clone)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    pub fn observe(&mut self, v: f64) {
        let i = self.bounds.partition_point(|b| *b < v);
        if i < self.counts.len() {
            self.counts[i] += 1;
        }
        self.sum += v;
        self.count += 1;
    }

    pub fn count(&self) -> u64 {
        self.count
    }

    pub fn sum(&self) -> f64 {
        self.sum
    }

    fn render(&self, out: &mut String, name: &str, help: &str, labels: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cum = 0;
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            cum += c;
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{b:?}\"}} {cum}");
        }
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum{{{labels}}} {:?}", self.sum);
        let _ = writeln!(out, "{name}_count{{{labels}}} {}", self.count);
    }
}

/// Everything the scheduler publishes (behind one mutex, updated once per step).
#[derive(Debug, Clone)]
pub struct Stats {
    pub num_running: usize,
    pub num_waiting: usize,
    /// Prompt tokens of waiting requests that are not cached (SGLang's
    /// `num_waiting_uncached_tokens`).
    pub waiting_uncached_tokens: usize,
    /// Prompt tokens of waiting requests (cached or not).
    pub waiting_tokens: usize,
    /// Tokens in use by running requests (locked cache paths + generated tokens).
    pub used_tokens: usize,
    pub cache_tokens: usize,
    pub evictable_tokens: usize,
    pub max_total_tokens: usize,
    /// Hit rate of the last prefill batch, `cached / (cached + computed)` prompt tokens, reset
    /// to 0 every 40 decode steps (SGLang's definition, see `sched.rs`).
    pub cache_hit_rate: f64,
    /// Requests retracted since the previous stats point (SGLang's `num_retracted_reqs`:
    /// reported at each prefill batch and every 40 decode steps).
    pub num_retracted_reqs: usize,
    /// Requests retracted since start (simulator addition).
    pub retractions_total: u64,
    /// The scheduler's current `new_token_ratio` estimate.
    pub new_token_ratio: f64,
    /// Generated tokens per wall-clock second over the last 40 decode steps.
    pub gen_throughput: f64,
    pub prompt_tokens_total: u64,
    pub generation_tokens_total: u64,
    pub cached_tokens_total: u64,
    pub num_requests_total: u64,
    pub ttft: Histogram,
    pub itl: Histogram,
    pub e2e: Histogram,
}

impl Stats {
    pub fn new(max_total_tokens: usize) -> Self {
        Stats {
            num_running: 0,
            num_waiting: 0,
            waiting_uncached_tokens: 0,
            waiting_tokens: 0,
            used_tokens: 0,
            cache_tokens: 0,
            evictable_tokens: 0,
            max_total_tokens,
            cache_hit_rate: 0.0,
            num_retracted_reqs: 0,
            retractions_total: 0,
            new_token_ratio: 0.0,
            gen_throughput: 0.0,
            prompt_tokens_total: 0,
            generation_tokens_total: 0,
            cached_tokens_total: 0,
            num_requests_total: 0,
            ttft: Histogram::new(TTFT_BUCKETS),
            itl: Histogram::new(ITL_BUCKETS),
            e2e: Histogram::new(E2E_BUCKETS),
        }
    }

    pub fn token_usage(&self) -> f64 {
        self.used_tokens as f64 / self.max_total_tokens.max(1) as f64
    }

    /// Prometheus text exposition (version 0.0.4), names as SGLang's `--enable-metrics`.
    pub fn render(&self, model: &str) -> String {
        let labels = format!(
            "model_name=\"{}\"",
            model.replace('\\', "\\\\").replace('"', "\\\"")
        );
        let mut o = String::with_capacity(8192);
        let gauges: [(&str, &str, f64); 8] = [
            (
                "num_running_reqs",
                "The number of running requests.",
                self.num_running as f64,
            ),
            (
                "num_queue_reqs",
                "The number of requests in the waiting queue.",
                self.num_waiting as f64,
            ),
            ("token_usage", "The token usage.", self.token_usage()),
            (
                "cache_hit_rate",
                "The prefix cache hit rate.",
                self.cache_hit_rate,
            ),
            (
                "gen_throughput",
                "The generation throughput (token/s).",
                self.gen_throughput,
            ),
            (
                "max_total_num_tokens",
                "Maximum total number of tokens in the KV cache.",
                self.max_total_tokens as f64,
            ),
            (
                "num_retracted_reqs",
                "The number of retracted requests.",
                self.num_retracted_reqs as f64,
            ),
            (
                "new_token_ratio",
                "The new token ratio.",
                self.new_token_ratio,
            ),
        ];
        for (n, help, v) in gauges {
            let _ = writeln!(
                o,
                "# HELP sglang:{n} {help}\n# TYPE sglang:{n} gauge\nsglang:{n}{{{labels}}} {v:?}"
            );
        }
        let counters: [(&str, &str, u64); 5] = [
            (
                "prompt_tokens",
                "Number of prefill tokens processed.",
                self.prompt_tokens_total,
            ),
            (
                "generation_tokens",
                "Number of generation tokens processed.",
                self.generation_tokens_total,
            ),
            (
                "cached_tokens",
                "Number of cached prompt tokens.",
                self.cached_tokens_total,
            ),
            (
                "num_requests",
                "Number of requests processed.",
                self.num_requests_total,
            ),
            (
                "num_retracted_requests",
                "Total number of retracted requests.",
                self.retractions_total,
            ),
        ];
        for (n, help, v) in counters {
            let _ = writeln!(o, "# HELP sglang:{n}_total {help}\n# TYPE sglang:{n}_total counter\nsglang:{n}_total{{{labels}}} {v:?}");
        }
        self.ttft.render(
            &mut o,
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            &labels,
        );
        self.itl.render(
            &mut o,
            "sglang:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            &labels,
        );
        self.e2e.render(
            &mut o,
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            &labels,
        );
        o
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_is_cumulative() {
        let mut h = Histogram::new(&[0.1, 1.0]);
        h.observe(0.05);
        h.observe(0.5);
        h.observe(5.0);
        let mut s = String::new();
        h.render(&mut s, "x", "help", "a=\"b\"");
        assert!(s.contains("x_bucket{a=\"b\",le=\"0.1\"} 1\n"));
        assert!(s.contains("x_bucket{a=\"b\",le=\"1.0\"} 2\n"));
        assert!(s.contains("x_bucket{a=\"b\",le=\"+Inf\"} 3\n"));
        assert!(s.contains("x_count{a=\"b\"} 3\n"));
    }
}
