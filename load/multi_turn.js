// Multi-turn chat: USERS concurrent users (VUs), each holding CONVERSATIONS conversations of TURNS
// turns in a row. Each turn resends the whole conversation: the system prompt (one of APPS shared
// system prompts of SYS_TOKENS tokens), every earlier user message (Q_TOKENS tokens each) and every
// earlier assistant answer exactly as the server streamed it, plus the new user message;
// OUT_TOKENS output tokens per turn (ignore_eos). A cache-aware router keeps a conversation on the
// worker that holds its history. See lib.js for the metrics, common env and thresholds.
import exec from 'k6/execution';
import { chat, envInt, MODELS, rng, summarize, text, thresholds, TREND_STATS, env } from './lib.js';

const p = {
  USERS: envInt('USERS', 32),
  CONVERSATIONS: envInt('CONVERSATIONS', 2),
  TURNS: envInt('TURNS', 6),
  APPS: envInt('APPS', 4),
  SYS_TOKENS: envInt('SYS_TOKENS', 1024),
  Q_TOKENS: envInt('Q_TOKENS', 96),
  OUT_TOKENS: envInt('OUT_TOKENS', 64),
  SEED: envInt('SEED', 1),
  MODELS,
};
p.TOTAL_REQUESTS = p.USERS * p.CONVERSATIONS * p.TURNS;

export const options = {
  scenarios: {
    multi_turn: {
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
  const id = user * 1000 + conv;
  const r = rng(p.SEED * 104729 + id);
  const messages = [{ role: 'system', content: systems[id % p.APPS] }];
  for (let t = 0; t < p.TURNS; t++) {
    messages.push({ role: 'user', content: `User ${user} conversation ${conv} turn ${t}: ` + text(r, p.Q_TOKENS) });
    const answer = chat(MODELS[id % MODELS.length], messages, p.OUT_TOKENS, `conv-${id}`);
    if (answer === null) return; // the conversation cannot go on without the answer
    messages.push({ role: 'assistant', content: answer });
  }
}

export function handleSummary(data) {
  return summarize('multi_turn', p, data);
}
