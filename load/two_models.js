// Two models on disjoint worker sets: shared-prefix groups where group g belongs to model
// MODELS[g mod 2] (default MODELS=a,b). Every request also carries `x-model: <model>` so a router
// that does not read bodies (Envoy-native load balancing) can route by header.
// See lib.js for the metrics, common env and thresholds.
import { groupWorkload } from './lib.js';

const w = groupWorkload('two_models', {
  GROUPS: 32, PROMPTS: 8, SYS_TOKENS: 2048, Q_TOKENS: 128, OUT_TOKENS: 64, CONCURRENCY: 32,
});
export const options = w.options;
export default function () {
  w.run();
}
export function handleSummary(data) {
  return w.handleSummary(data);
}
