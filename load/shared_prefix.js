// Shared-prefix groups (SGLang bench_serving "generated-shared-prefix" shape), streaming chat.
//
// GROUPS x PROMPTS prompts; every prompt of a group starts with the same system prompt of
// SYS_TOKENS tokens, followed by a distinct question of Q_TOKENS tokens; OUT_TOKENS output tokens
// (ignore_eos). Issued in a seeded shuffled order by CONCURRENCY virtual users. See lib.js for the
// metrics, the common env (TARGET/TARGETS, MODEL/MODELS, SEED, SUMMARY, ...) and thresholds.
import { groupWorkload } from './lib.js';

const w = groupWorkload('shared_prefix', {
  GROUPS: 16, PROMPTS: 8, SYS_TOKENS: 1024, Q_TOKENS: 64, OUT_TOKENS: 32, CONCURRENCY: 8,
});
export const options = w.options;
export default function () {
  w.run();
}
export function handleSummary(data) {
  return w.handleSummary(data);
}
