// Shared-prefix groups (SGLang bench_serving "generated-shared-prefix" shape), streaming chat.
//
// G groups x P prompts; every prompt of a group starts with the same system prompt of S tokens,
// followed by a distinct question of Q tokens; O output tokens are requested (ignore_eos).
// Prompts are issued in a seeded shuffled order by C concurrent virtual users.
//
// TTFT is k6's time to first byte: SGLang (and our simulator) send the HTTP headers of a streaming
// chat response together with the first token, so `waiting` is time to first token.
//
// Env: TARGET (http://127.0.0.1:10000), MODEL, GROUPS, PROMPTS, SYS_TOKENS, Q_TOKENS, OUT_TOKENS,
// CONCURRENCY, SEED, SUMMARY (path of the JSON summary), MAX_DURATION.
import http from 'k6/http';
import { check } from 'k6';
import { Trend, Counter, Rate } from 'k6/metrics';
import exec from 'k6/execution';

const env = (k, d) => (__ENV[k] === undefined || __ENV[k] === '' ? d : __ENV[k]);
const TARGET = env('TARGET', 'http://127.0.0.1:10000');
const MODEL = env('MODEL', 'llama');
const GROUPS = parseInt(env('GROUPS', '16'));
const PROMPTS = parseInt(env('PROMPTS', '8'));
const SYS_TOKENS = parseInt(env('SYS_TOKENS', '1024'));
const Q_TOKENS = parseInt(env('Q_TOKENS', '64'));
const OUT_TOKENS = parseInt(env('OUT_TOKENS', '32'));
const CONCURRENCY = parseInt(env('CONCURRENCY', '8'));
const SEED = parseInt(env('SEED', '1'));
const SUMMARY = env('SUMMARY', '');

const ttft = new Trend('ttft', true);
const e2e = new Trend('e2e', true);
const tpot = new Trend('tpot', true);
const errors = new Counter('errors');
const ok = new Rate('ok');

export const options = {
  scenarios: {
    shared_prefix: {
      executor: 'shared-iterations',
      vus: CONCURRENCY,
      iterations: GROUPS * PROMPTS,
      maxDuration: env('MAX_DURATION', '10m'),
    },
  },
  thresholds: {
    ok: ['rate>0.99'],
    errors: ['count<1'],
  },
  summaryTrendStats: ['avg', 'min', 'med', 'p(90)', 'p(99)', 'max'],
};

// Small deterministic PRNG (mulberry32) so every router sees the same prompts in the same order.
function rng(seed) {
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

// ~1 token per word of this vocabulary (word + space is ~6 bytes; the simulator's tokenizer is
// documented in sim/README.md).
function text(r, tokens) {
  const out = [];
  for (let i = 0; i < tokens; i++) out.push(WORDS[Math.floor(r() * WORDS.length)]);
  return out.join(' ');
}

const order = (() => {
  const r = rng(SEED);
  const idx = [];
  for (let i = 0; i < GROUPS * PROMPTS; i++) idx.push(i);
  for (let i = idx.length - 1; i > 0; i--) {
    const j = Math.floor(r() * (i + 1));
    [idx[i], idx[j]] = [idx[j], idx[i]];
  }
  return idx;
})();

const systems = [];
for (let g = 0; g < GROUPS; g++) systems.push(`Group ${g}. ` + text(rng(SEED * 7919 + g), SYS_TOKENS));

export default function () {
  const k = order[exec.scenario.iterationInTest % order.length];
  const g = Math.floor(k / PROMPTS);
  const question = `Question ${k}: ` + text(rng(SEED * 104729 + k), Q_TOKENS);
  const body = JSON.stringify({
    model: MODEL,
    messages: [
      { role: 'system', content: systems[g] },
      { role: 'user', content: question },
    ],
    max_tokens: OUT_TOKENS,
    ignore_eos: true,
    stream: true,
    stream_options: { include_usage: true },
  });
  const res = http.post(`${TARGET}/v1/chat/completions`, body, {
    headers: { 'content-type': 'application/json' },
    timeout: '300s',
  });
  const good = check(res, {
    'status 200': (r) => r.status === 200,
    'stream done': (r) => typeof r.body === 'string' && r.body.includes('data: [DONE]'),
  });
  ok.add(good);
  if (!good) {
    errors.add(1);
    return;
  }
  ttft.add(res.timings.waiting);
  e2e.add(res.timings.duration);
  if (OUT_TOKENS > 1) tpot.add((res.timings.duration - res.timings.waiting) / (OUT_TOKENS - 1));
}

export function handleSummary(data) {
  const m = (name) => (data.metrics[name] ? data.metrics[name].values : {});
  const summary = {
    scenario: 'shared_prefix',
    params: { GROUPS, PROMPTS, SYS_TOKENS, Q_TOKENS, OUT_TOKENS, CONCURRENCY, SEED },
    requests: (m('http_reqs').count || 0),
    rps: (m('http_reqs').rate || 0),
    errors: (m('errors').count || 0),
    ttft_ms: m('ttft'),
    e2e_ms: m('e2e'),
    tpot_ms: m('tpot'),
    duration_s: data.state.testRunDurationMs / 1000,
  };
  const out = { stdout: JSON.stringify(summary) + '\n' };
  if (SUMMARY) out[SUMMARY] = JSON.stringify(summary, null, 2);
  return out;
}
