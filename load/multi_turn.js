// Multi-turn chat: USERS concurrent users (VUs), each holding CONVERSATIONS conversations of TURNS
// turns in a row. Each turn resends the whole conversation: the system prompt (one of APPS shared
// system prompts of SYS_TOKENS tokens), every earlier user message (Q_TOKENS tokens each) and every
// earlier assistant answer exactly as the server streamed it, plus the new user message;
// OUT_TOKENS output tokens per turn (ignore_eos). A cache-aware router keeps a conversation on the
// worker that holds its history. See lib.js for the metrics, common env and thresholds.
//
// DURATION=S (seconds; load/compare --membership): time-bound instead: the USERS users start
// conversation after conversation (CONVERSATIONS is ignored) for S seconds; no turn starts after
// that, and a conversation under way stops there (its last turn finishes). RECORDS=1: one console
// line per request, `TRACE {"i","w","d","s","t0","t1","ttft"}` (run k6 with --log-format raw
// --console-output FILE): a unique index, the `x-worker-id` response header (the worker that
// served it), `x-prefix-router-decision` (when the router sets it), the HTTP status (0: no answer;
// -1: 200 but the stream did not end), the send and end times (Unix ms) and the TTFT (ms).
import exec from 'k6/execution';
import { envInt, MODELS, rng, stream, summarize, text, thresholds, TREND_STATS, env } from './lib.js';

const p = {
  USERS: envInt('USERS', 32),
  CONVERSATIONS: envInt('CONVERSATIONS', 2),
  TURNS: envInt('TURNS', 6),
  APPS: envInt('APPS', 4),
  SYS_TOKENS: envInt('SYS_TOKENS', 1024),
  Q_TOKENS: envInt('Q_TOKENS', 96),
  OUT_TOKENS: envInt('OUT_TOKENS', 64),
  SEED: envInt('SEED', 1),
  DURATION: envInt('DURATION', 0),
  RECORDS: env('RECORDS', '0') === '1',
  MODELS,
};
// Time-bound runs have no fixed count (null: load/compare then checks no request count).
p.TOTAL_REQUESTS = p.DURATION > 0 ? null : p.USERS * p.CONVERSATIONS * p.TURNS;

export const options = {
  scenarios: {
    multi_turn: p.DURATION > 0 ? {
      executor: 'constant-vus',
      vus: p.USERS,
      duration: `${p.DURATION}s`,
      gracefulStop: '120s', // the turn under way at the end finishes (no new one starts)
    } : {
      executor: 'per-vu-iterations',
      vus: p.USERS,
      iterations: p.CONVERSATIONS,
      maxDuration: env('MAX_DURATION', '20m'),
    },
  },
  thresholds: thresholds(),
  summaryTrendStats: TREND_STATS,
};

const systems = [];
for (let a = 0; a < p.APPS; a++) systems.push(`App ${a}. ` + text(rng(p.SEED * 7919 + a), p.SYS_TOKENS));

export default function () {
  const user = exec.vu.idInTest;
  const conv = exec.vu.iterationInScenario;
  // (time-bound runs: room for many conversations per user; counted runs keep their ids and prompts)
  const id = user * (p.DURATION > 0 ? 100000 : 1000) + conv;
  const r = rng(p.SEED * 104729 + id);
  const messages = [{ role: 'system', content: systems[id % p.APPS] }];
  const end = exec.scenario.startTime + p.DURATION * 1000;
  for (let t = 0; t < p.TURNS; t++) {
    if (p.DURATION > 0 && Date.now() >= end) return;
    messages.push({ role: 'user', content: `User ${user} conversation ${conv} turn ${t}: ` + text(r, p.Q_TOKENS) });
    const t0 = Date.now();
    const { res, content } = stream('/v1/chat/completions', { model: MODELS[id % MODELS.length], messages },
      p.OUT_TOKENS, `conv-${id}`);
    if (p.RECORDS) {
      console.log('TRACE ' + JSON.stringify({
        i: id * 100 + t,
        w: res.headers['X-Worker-Id'] || null,
        d: res.headers['X-Prefix-Router-Decision'] || null,
        s: content === null && res.status === 200 ? -1 : res.status,
        t0,
        t1: Date.now(),
        ttft: content === null ? null : res.timings.waiting,
      }));
    }
    if (content === null) return; // the conversation cannot go on without the answer
    messages.push({ role: 'assistant', content });
  }
}

export function handleSummary(data) {
  return summarize('multi_turn', p, data);
}
