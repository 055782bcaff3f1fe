// Skewed popularity (the hot-spot case): REQUESTS streaming chat requests whose prefix group is
// drawn from Zipf(ZIPF_S) over GROUPS groups (rank 0 hottest: with s = 1.1 and 64 groups it gets
// ~25% of the requests, twice an 8-worker fleet's fair share). Each request: the group's system
// prompt (SYS_TOKENS) + a distinct question (Q_TOKENS), OUT_TOKENS output tokens.
// See lib.js for the metrics, common env and thresholds.
import { groupWorkload } from './lib.js';

const w = groupWorkload('skewed', {
  GROUPS: 64, REQUESTS: 512, ZIPF_S: 1.1, SYS_TOKENS: 2048, Q_TOKENS: 128, OUT_TOKENS: 64, CONCURRENCY: 32,
});
export const options = w.options;
export default function () {
  w.run();
}
export function handleSummary(data) {
  return w.handleSummary(data);
}
