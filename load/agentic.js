// Agentic sessions: CONVERSATIONS long tool-using conversations that all begin with the same system
// prompt of SYS_TOKENS tokens (an agent's instructions and tool schemas) followed by the
// conversation's own task (TASK_TOKENS). Every turn resends the whole conversation and then grows
// it: the assistant's answer exactly as the server streamed it (OUT_TOKENS, ignore_eos: a tool
// call) and a tool result of TOOL_TOKENS tokens (role "tool"), up to MAX_TURNS requests per
// conversation. A cache-aware router must keep each conversation on the worker holding its history
// while every conversation also matches the shared system prompt on every worker that has seen one.
//
// Popularity is skewed: REQUESTS turn slots are drawn one after another, each picking the
// conversation that advances next from Zipf(ZIPF_S) over the conversations' popularity ranks (a
// seeded permutation), among those with turns left. Conversations are partitioned across the
// CONCURRENCY clients (VUs) so that no two clients ever advance the same conversation: largest
// turn count first onto the client with the fewest turns so far (clients get near-equal work);
// each client plays its conversations' turns in the global draw order, one request at a time.
//
// API=chat (default): streaming `/v1/chat/completions` with the messages. API=completions: the same
// conversation as one text prompt on streaming `/v1/completions`: the messages' contents in order,
// each padded with spaces to a multiple of 4 bytes (the simulator's tokens are 4 bytes, so the
// previous answer, sent back, is exactly the tokens that were generated and the history stays a
// prefix of the next prompt); no role markers.
// See lib.js for the metrics, common env (TARGETS, PIN, SEED, ...) and thresholds.
import exec from 'k6/execution';
import { chat, env, envFloat, envInt, MODELS, rng, shuffled, stream, summarize, text, thresholds, TREND_STATS } from './lib.js';

const p = {
  CONVERSATIONS: envInt('CONVERSATIONS', 40),
  MAX_TURNS: envInt('MAX_TURNS', 12),
  REQUESTS: envInt('REQUESTS', 360),
  ZIPF_S: envFloat('ZIPF_S', 1.0),
  SYS_TOKENS: envInt('SYS_TOKENS', 3000),
  TASK_TOKENS: envInt('TASK_TOKENS', 200),
  TOOL_TOKENS: envInt('TOOL_TOKENS', 256),
  OUT_TOKENS: envInt('OUT_TOKENS', 128),
  CONCURRENCY: envInt('CONCURRENCY', 16),
  SEED: envInt('SEED', 1),
  API: env('API', 'chat'),
  MODELS,
};
if (p.API !== 'completions' && p.API !== 'chat') throw new Error(`API must be completions or chat, not ${p.API}`);

const pad4 = (s) => s + ' '.repeat((4 - (s.length % 4)) % 4);
const flat = (messages) => messages.map((m) => pad4(m.content)).join('');

// ---- The plan (the same in every VU: deterministic in SEED) ----
const rank2conv = shuffled(p.CONVERSATIONS, p.SEED * 31 + 11);
const weight = new Array(p.CONVERSATIONS).fill(0);
for (let k = 0; k < p.CONVERSATIONS; k++) weight[rank2conv[k]] = 1 / Math.pow(k + 1, p.ZIPF_S);
const turns = new Array(p.CONVERSATIONS).fill(0);
const order = []; // conversation of each global turn slot
{
  const r = rng(p.SEED * 65537 + 5);
  for (let i = 0; i < p.REQUESTS; i++) {
    let total = 0;
    for (let c = 0; c < p.CONVERSATIONS; c++) if (turns[c] < p.MAX_TURNS) total += weight[c];
    if (total === 0) break; // every conversation at MAX_TURNS
    let x = r() * total;
    let pick = -1;
    for (let c = 0; c < p.CONVERSATIONS; c++) {
      if (turns[c] >= p.MAX_TURNS) continue;
      pick = c;
      x -= weight[c];
      if (x < 0) break;
    }
    turns[pick] += 1;
    order.push(pick);
  }
}
const owner = new Array(p.CONVERSATIONS).fill(-1);
{
  const load = new Array(p.CONCURRENCY).fill(0);
  const byTurns = [...Array(p.CONVERSATIONS).keys()].sort((a, b) => turns[b] - turns[a] || a - b);
  for (const c of byTurns) {
    if (turns[c] === 0) continue;
    let v = 0;
    for (let u = 1; u < p.CONCURRENCY; u++) if (load[u] < load[v]) v = u;
    owner[c] = v;
    load[v] += turns[c];
  }
}
const plan = []; // plan[v]: conversations of VU v's requests, in global draw order
for (let v = 0; v < p.CONCURRENCY; v++) plan.push([]);
for (const c of order) plan[owner[c]].push(c);
const perVu = Math.max(1, ...plan.map((l) => l.length));

p.TOTAL_REQUESTS = order.length;
p.CONVERSATIONS_USED = turns.filter((t) => t > 0).length;
p.MAX_TURNS_REACHED = turns.filter((t) => t >= p.MAX_TURNS).length;
p.REQUESTS_PER_VU = `${Math.min(...plan.map((l) => l.length))}-${perVu}`;

export const options = {
  scenarios: {
    agentic: {
      executor: 'per-vu-iterations',
      vus: p.CONCURRENCY,
      iterations: perVu,
      maxDuration: env('MAX_DURATION', '20m'),
    },
  },
  thresholds: thresholds(),
  summaryTrendStats: TREND_STATS,
};

const SYSTEM = 'You are a coding agent. Use the tools to solve the task; answer with one tool call per turn. ' +
  text(rng(p.SEED * 7919 + 1), p.SYS_TOKENS);

// ---- Per VU: the state of its own conversations ----
const convs = {};

function conversation(c) {
  if (convs[c] === undefined) {
    convs[c] = {
      r: rng(p.SEED * 104729 + c),
      turn: 0,
      dead: false,
      messages: [{ role: 'system', content: SYSTEM }],
    };
    convs[c].messages.push({ role: 'user', content: `Task ${c}: ` + text(convs[c].r, p.TASK_TOKENS) });
  }
  return convs[c];
}

export default function () {
  const mine = plan[exec.vu.idInTest - 1] || [];
  const c = mine[exec.vu.iterationInScenario];
  if (c === undefined) return; // this VU has fewer turns than the busiest one
  const s = conversation(c);
  if (s.dead) return; // an earlier turn failed: the conversation cannot go on without its answer
  if (s.turn > 0) {
    s.messages.push({
      role: 'tool',
      tool_call_id: `call_${c}_${s.turn}`,
      content: `Result of call ${s.turn} in task ${c}: ` + text(s.r, p.TOOL_TOKENS),
    });
  }
  const model = MODELS[c % MODELS.length];
  const answer = p.API === 'chat'
    ? chat(model, s.messages, p.OUT_TOKENS, `conv-${c}`)
    : stream('/v1/completions', { model, prompt: flat(s.messages) }, p.OUT_TOKENS, `conv-${c}`).content;
  if (answer === null) {
    s.dead = true;
    return;
  }
  s.messages.push({ role: 'assistant', content: answer });
  s.turn += 1;
}

export function handleSummary(data) {
  return summarize('agentic', p, data);
}
