// The job statuses and event kinds, as the server names them (server/kinds.py: JobStatus,
// EventKind). The one table the pages read; tests/web/test_kinds.py fails when the two disagree.

// status -> label (what the badge and the filter say), terminal (no transition leaves it),
// css (the badge's class in css/app.css)
export const STATUSES = {
  validating: { label: "validating", terminal: false, css: "status-validating" },
  queued: { label: "queued", terminal: false, css: "status-queued" },
  running: { label: "running", terminal: false, css: "status-running" },
  cancelling: { label: "cancelling", terminal: false, css: "status-cancelling" },
  pausing: { label: "pausing", terminal: false, css: "status-pausing" },
  paused: { label: "paused", terminal: false, css: "status-paused" },
  interrupted: { label: "interrupted", terminal: false, css: "status-interrupted" },
  succeeded: { label: "succeeded", terminal: true, css: "status-succeeded" },
  failed: { label: "failed", terminal: true, css: "status-failed" },
  cancelled: { label: "cancelled", terminal: true, css: "status-cancelled" },
};

// event kind (also the name the job stream sends it under) -> label (in the event log), chart
// (true: the charts and figures consume it; false: it is a line of the event log)
export const EVENT_KINDS = {
  state: { label: "state", chart: false },
  metrics: { label: "metrics", chart: true },
  telemetry: { label: "telemetry", chart: true },
  log: { label: "log", chart: false },
  checkpoint: { label: "checkpoint", chart: false },
  resume: { label: "resume", chart: false },
  partition: { label: "partition", chart: false },
  repartition: { label: "repartition", chart: false },
  reference: { label: "reference", chart: false },
  tracker: { label: "tracker", chart: false },
  skipped: { label: "skipped step", chart: false },
  boxes: { label: "boxes", chart: false },
  samples: { label: "samples", chart: false },
  rollouts: { label: "rollouts", chart: false },
};

// A job in this status can still change.
export function isActive(status) {
  return status in STATUSES && !STATUSES[status].terminal;
}
