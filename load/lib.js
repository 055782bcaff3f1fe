// Shared pieces of the k6 scenarios in load/: env parameters, a seeded PRNG, prompt text of an exact
// token length, one streaming request (chat or completions) with its metrics, the prefix-group workloads
// (uniform shuffled groups, Zipf-skewed groups, several models, long context) and the JSON summary.
//
// Metrics (all scenarios): `ttft` (k6 `res.timings.waiting` of a streaming request: SGLang and
// sglang-sim send the response head with the first token, so time to first byte is TTFT), `e2e`
// (`res.timings.duration`, whole stream), `tpot` ((e2e - ttft) / (completion tokens - 1)),
// `errors` (non-200 or a stream without `[DONE]`), `ok` (rate), `out_tokens` (counter).
//
// Common env: TARGET (http://127.0.0.1:10000) or TARGETS (comma-separated router replicas: each
// request goes to a random one, or with PIN=1 every request of a conversation / prompt group goes to
// the replica its id hashes to), MODEL or MODELS (comma-separated), SEED, CONCURRENCY, OUT_TOKENS,
// SUMMARY (path of the JSON summary), MAX_DURATION, and optional extra thresholds TTFT_P99_MS /
// E2E_P99_MS.
import http from 'k6/http';
import { check } from 'k6';
import { Trend, Counter, Rate } from 'k6/metrics';
import exec from 'k6/execution';

export const env = (k, d) => (__ENV[k] === undefined || __ENV[k] === '' ? d : __ENV[k]);
export const envInt = (k, d) => parseInt(env(k, String(d)), 10);
export const envFloat = (k, d) => parseFloat(env(k, String(d)));

export const TARGETS = env('TARGETS', env('TARGET', 'http://127.0.0.1:10000')).split(',').map((s) => s.trim()).filter(Boolean);
export const MODELS = env('MODELS', env('MODEL', 'llama')).split(',').map((s) => s.trim()).filter(Boolean);
export const SUMMARY = env('SUMMARY', '');

export const metrics = {
  ttft: new Trend('ttft', true),
  e2e: new Trend('e2e', true),
  tpot: new Trend('tpot', true),
  errors: new Counter('errors'),
  ok: new Rate('ok'),
  outTokens: new Counter('out_tokens'),
};

export const PIN = ['1', 'true', 'yes'].includes(env('PIN', '0').toLowerCase());

/// FNV-1a (32 bit) of a string: the replica a pinned key goes to.
export function fnv1a(str) {
  let h = 0x811c9dc5;
  for (let i = 0; i < str.length; i++) {
    h ^= str.charCodeAt(i);
    h = Math.imul(h, 0x01000193) >>> 0;
  }
  return h >>> 0;
}

let pickRng = null; // per VU, seeded: the same VU makes the same random picks in every run

/// The router replica for one request. One target: that one. Several: with PIN and a `key` (the
/// conversation or prompt group id), the replica the key hashes to, so all its requests meet the
/// same replica; otherwise a uniformly random replica per request (a load balancer spraying
/// requests over the replicas, as an L4 balancer in front of a gateway fleet does).
export function target(key) {
  if (TARGETS.length === 1) return TARGETS[0];
  if (PIN && key !== undefined && key !== null) return TARGETS[fnv1a(String(key)) % TARGETS.length];
  if (pickRng === null) pickRng = rng(envInt('SEED', 1) * 7777 + exec.vu.idInTest);
  return TARGETS[Math.floor(pickRng() * TARGETS.length)];
}

/// Thresholds every scenario carries, plus optional latency ones from the environment.
export function thresholds() {
  const t = { ok: ['rate>0.99'], errors: ['count<1'] };
  if (env('TTFT_P99_MS', '')) t.ttft = [`p(99)<${env('TTFT_P99_MS')}`];
  if (env('E2E_P99_MS', '')) t.e2e = [`p(99)<${env('E2E_P99_MS')}`];
  return t;
}

export const TREND_STATS = ['avg', 'min', 'med', 'p(90)', 'p(99)', 'max'];

/// Small deterministic PRNG (mulberry32) so every router sees the same prompts in the same order.
export function rng(seed) {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

const WORDS = ('alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike ' +
  'november oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu').split(' ');

/// ASCII text of exactly 4 * tokens bytes: exactly `tokens` tokens for sglang-sim's tokenizer
/// (4 bytes per token, sim/README.md), about `tokens` for a real BPE tokenizer on English.
export function text(r, tokens) {
  const want = tokens * 4;
  const out = [];
  let len = 0;
  while (len < want) {
    const w = WORDS[Math.floor(r() * WORDS.length)];
    out.push(w);
    len += w.length + 1;
  }
  return out.join(' ').slice(0, want);
}

/// Seeded Fisher-Yates permutation of 0..n-1.
export function shuffled(n, seed) {
  const r = rng(seed);
  const idx = [];
  for (let i = 0; i < n; i++) idx.push(i);
  for (let i = idx.length - 1; i > 0; i--) {
    const j = Math.floor(r() * (i + 1));
    [idx[i], idx[j]] = [idx[j], idx[i]];
  }
  return idx;
}

/// Zipf(s) over 0..n-1 (rank 0 the most popular): returns u in [0,1) -> index.
export function zipf(n, s) {
  const cdf = [];
  let acc = 0;
  for (let k = 1; k <= n; k++) {
    acc += 1 / Math.pow(k, s);
    cdf.push(acc);
  }
  return (u) => {
    const x = u * acc;
    let lo = 0;
    let hi = n - 1;
    while (lo < hi) {
      const mid = (lo + hi) >> 1;
      if (cdf[mid] < x) lo = mid + 1;
      else hi = mid;
    }
    return lo;
  };
}

/// Content of an SSE chat or completions stream: the concatenated `delta.content`s (chat) or
/// `text`s (completions) and the usage, if any.
export function parseStream(body) {
  let content = '';
  let usage = null;
  for (const line of body.split('\n')) {
    if (!line.startsWith('data: ') || line === 'data: [DONE]') continue;
    let ev;
    try {
      ev = JSON.parse(line.slice(6));
    } catch (e) {
      continue;
    }
    if (ev.usage) usage = ev.usage;
    const c = ev.choices && ev.choices[0];
    if (c && c.delta && typeof c.delta.content === 'string') content += c.delta.content;
    else if (c && typeof c.text === 'string') content += c.text;
  }
  return { content, usage };
}

/// One streaming request to `path` (`/v1/chat/completions` or `/v1/completions`): `payload` (model
/// and messages or prompt) plus exactly `outTokens` output tokens (ignore_eos), streamed with usage.
/// Records ttft/e2e/tpot/errors. Returns { res, ok, content } (content: the streamed text, null on
/// error). `key`: the conversation / prompt group id that PIN=1 keeps on one router replica (see
/// target()).
export function stream(path, payload, outTokens, key) {
  const body = JSON.stringify(Object.assign({}, payload, {
    max_tokens: outTokens,
    ignore_eos: true,
    stream: true,
    stream_options: { include_usage: true },
  }));
  const res = http.post(`${target(key)}${path}`, body, {
    // x-model lets a body-blind router (Envoy-native load balancing) route several models by header.
    headers: { 'content-type': 'application/json', 'x-model': payload.model },
    timeout: '600s',
  });
  const good = check(res, {
    'status 200': (r) => r.status === 200,
    'stream done': (r) => typeof r.body === 'string' && r.body.includes('data: [DONE]'),
  });
  metrics.ok.add(good);
  if (!good) {
    metrics.errors.add(1);
    return { res, ok: false, content: null };
  }
  const { content, usage } = parseStream(res.body);
  const n = usage && usage.completion_tokens ? usage.completion_tokens : outTokens;
  metrics.ttft.add(res.timings.waiting);
  metrics.e2e.add(res.timings.duration);
  metrics.outTokens.add(n);
  if (n > 1) metrics.tpot.add((res.timings.duration - res.timings.waiting) / (n - 1));
  return { res, ok: true, content };
}

/// One streaming chat request (see stream()). Returns the assistant's answer (as streamed by the
/// server) or null on error.
export function chat(model, messages, outTokens, key) {
  return stream('/v1/chat/completions', { model, messages }, outTokens, key).content;
}

/// handleSummary body: one JSON object (stdout and $SUMMARY).
export function summarize(scenario, params, data) {
  const m = (name) => (data.metrics[name] ? data.metrics[name].values : {});
  const dur = data.state.testRunDurationMs / 1000;
  const summary = {
    scenario,
    params,
    targets: TARGETS.length,
    pin: PIN,
    requests: m('http_reqs').count || 0,
    rps: m('http_reqs').rate || 0,
    errors: m('errors').count || 0,
    out_tokens: m('out_tokens').count || 0,
    out_tokens_per_s: dur > 0 ? (m('out_tokens').count || 0) / dur : 0,
    ttft_ms: m('ttft'),
    e2e_ms: m('e2e'),
    tpot_ms: m('tpot'),
    duration_s: dur,
    thresholds_ok: Object.values(data.metrics).every((v) => !v.thresholds || Object.values(v.thresholds).every((t) => t.ok)),
  };
  const out = { stdout: JSON.stringify(summary) + '\n' };
  if (SUMMARY) out[SUMMARY] = JSON.stringify(summary, null, 2);
  return out;
}

/// Prefix-group workloads (SGLang bench_serving "generated-shared-prefix" shape).
///
/// GROUPS groups; every prompt of group g starts with the same system prompt of SYS_TOKENS tokens
/// (a document, for long context), followed by a distinct question of Q_TOKENS tokens; OUT_TOKENS
/// output tokens (ignore_eos). Group g belongs to model MODELS[g mod len]. Order:
///  * ZIPF_S = 0: every group PROMPTS times, seeded shuffle (GROUPS * PROMPTS requests);
///  * ZIPF_S > 0: REQUESTS requests, group rank ~ Zipf(ZIPF_S) (rank 0 hottest), groups' ranks are
///    a seeded permutation (so the hot group is not always group 0).
/// CONCURRENCY VUs share the iterations (closed loop).
export function groupWorkload(scenario, defaults) {
  const d = (k) => defaults[k];
  const p = {
    GROUPS: envInt('GROUPS', d('GROUPS')),
    PROMPTS: envInt('PROMPTS', d('PROMPTS')),
    REQUESTS: envInt('REQUESTS', d('REQUESTS') || 0),
    ZIPF_S: envFloat('ZIPF_S', d('ZIPF_S') || 0),
    SYS_TOKENS: envInt('SYS_TOKENS', d('SYS_TOKENS')),
    Q_TOKENS: envInt('Q_TOKENS', d('Q_TOKENS')),
    OUT_TOKENS: envInt('OUT_TOKENS', d('OUT_TOKENS')),
    CONCURRENCY: envInt('CONCURRENCY', d('CONCURRENCY')),
    SEED: envInt('SEED', 1),
    MODELS,
  };
  const total = p.ZIPF_S > 0 ? p.REQUESTS : p.GROUPS * p.PROMPTS;
  p.TOTAL_REQUESTS = total;

  let order;
  if (p.ZIPF_S > 0) {
    const pick = zipf(p.GROUPS, p.ZIPF_S);
    const rank2group = shuffled(p.GROUPS, p.SEED * 31 + 7);
    const r = rng(p.SEED * 65537 + 3);
    order = [];
    for (let i = 0; i < total; i++) order.push(rank2group[pick(r())] * 1000003 + i);
  } else {
    order = shuffled(total, p.SEED).map((k) => Math.floor(k / p.PROMPTS) * 1000003 + k);
  }

  const systems = {}; // built lazily per VU: long documents cost time to generate
  const system = (g) => {
    if (systems[g] === undefined) systems[g] = `Group ${g}. ` + text(rng(p.SEED * 7919 + g), p.SYS_TOKENS);
    return systems[g];
  };

  return {
    params: p,
    options: {
      scenarios: {
        [scenario]: {
          executor: 'shared-iterations',
          vus: p.CONCURRENCY,
          iterations: total,
          maxDuration: env('MAX_DURATION', '20m'),
        },
      },
      thresholds: thresholds(),
      summaryTrendStats: TREND_STATS,
    },
    run() {
      const code = order[exec.scenario.iterationInTest % order.length];
      const g = Math.floor(code / 1000003);
      const k = code % 1000003;
      const question = `Question ${k}: ` + text(rng(p.SEED * 104729 + k), p.Q_TOKENS);
      chat(MODELS[g % MODELS.length], [
        { role: 'system', content: system(g) },
        { role: 'user', content: question },
      ], p.OUT_TOKENS, `group-${g}`);
    },
    handleSummary(data) {
      return summarize(scenario, p, data);
    },
  };
}
