// Long context: GROUPS documents of SYS_TOKENS tokens (default 32768, i.e. 128 KiB of text) each
// asked PROMPTS distinct questions, shuffled. Workers need --context-length above
// SYS_TOKENS + Q_TOKENS + OUT_TOKENS (sglang-sim's default is 8192) and a KV capacity of a few
// documents. See lib.js for the metrics, common env and thresholds.
import { groupWorkload } from './lib.js';

const w = groupWorkload('long_context', {
  GROUPS: 8, PROMPTS: 6, SYS_TOKENS: 32768, Q_TOKENS: 256, OUT_TOKENS: 32, CONCURRENCY: 8,
});
export const options = w.options;
export default function () {
  w.run();
}
export function handleSummary(data) {
  return w.handleSummary(data);
}
