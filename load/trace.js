// Open-loop trace replay (load/compare --scenario trace): PLAN names a JSON file from
// prkit.trace.replay_plan: per request its send offset `t` (ms after the first, already divided by
// the replay speed), its prompt as blocks [index into `texts`, tokens] (a block is the first
// 4 * tokens bytes of its text) and its output tokens `o`. Request i is sent at start + LEAD_MS +
// t_i whether or not earlier ones have finished: VUS virtual users share the iterations in order,
// each sleeping until its request's send time (enough VUs that one is always free, or requests go
// out late).
//
// API=completions (default): streaming `/v1/completions` with the text prompt; API=chat: streaming
// `/v1/chat/completions` with one user message. Exactly `o` output tokens (ignore_eos).
//
// Per request, one console line `TRACE {"i","w","d","s","late","ttft","e2e"}` (run k6 with
// --log-format raw --console-output FILE): its index, the `x-worker-id` response header (the
// worker that served it), `x-prefix-router-decision` (when the router sets it), the HTTP status,
// how late it was sent (ms after its send time) and its TTFT / E2E (ms). The `lateness` trend has
// the same lateness. See lib.js for the other metrics, the common env and the thresholds.
import { sleep } from 'k6';
import { SharedArray } from 'k6/data';
import exec from 'k6/execution';
import { Trend } from 'k6/metrics';
import { env, envInt, MODELS, stream, summarize, thresholds, TREND_STATS } from './lib.js';

const PLAN = env('PLAN', '');
const requests = new SharedArray('requests', () => JSON.parse(open(PLAN)).requests);
const texts = new SharedArray('texts', () => JSON.parse(open(PLAN)).texts);
const lateness = new Trend('lateness', true);

const p = {
  PLAN,
  API: env('API', 'completions'),
  VUS: envInt('VUS', 256),
  // The first request goes out LEAD_MS after the scenario starts: every VU's first iteration
  // (JS warm-up, its first prompt) runs before any send time instead of delaying the first ones.
  LEAD_MS: envInt('LEAD_MS', 2000),
  MODELS,
  TOTAL_REQUESTS: requests.length,
};
if (p.API !== 'completions' && p.API !== 'chat') throw new Error(`API must be completions or chat, not ${p.API}`);
const lastSend = requests.length ? requests[requests.length - 1].t / 1000 : 0;

export const options = {
  scenarios: {
    trace: {
      executor: 'shared-iterations',
      vus: Math.max(1, Math.min(p.VUS, requests.length)),
      iterations: requests.length,
      // the replay itself plus time for the last requests to finish
      maxDuration: env('MAX_DURATION', `${Math.ceil(p.LEAD_MS / 1000 + lastSend + 600)}s`),
    },
  },
  thresholds: thresholds(),
  summaryTrendStats: TREND_STATS,
};

function prompt(blocks) {
  const parts = [];
  for (const [k, tokens] of blocks) parts.push(texts[k].substring(0, 4 * tokens));
  return parts.join('');
}

export default function () {
  const i = exec.scenario.iterationInTest;
  const r = requests[i];
  const text = prompt(r.b); // built before the wait: not part of the lateness
  const due = exec.scenario.startTime + p.LEAD_MS + r.t;
  const wait = due - Date.now();
  if (wait > 0) sleep(wait / 1000);
  const late = Math.max(0, Date.now() - due);
  lateness.add(late);
  const model = MODELS[0];
  const payload = p.API === 'chat' ? { model, messages: [{ role: 'user', content: text }] } : { model, prompt: text };
  const path = p.API === 'chat' ? '/v1/chat/completions' : '/v1/completions';
  const { res } = stream(path, payload, r.o, r.k);
  console.log('TRACE ' + JSON.stringify({
    i,
    w: res.headers['X-Worker-Id'] || null,
    d: res.headers['X-Prefix-Router-Decision'] || null,
    s: res.status,
    late,
    ttft: res.timings.waiting,
    e2e: res.timings.duration,
  }));
}

export function handleSummary(data) {
  return summarize('trace', p, data);
}
