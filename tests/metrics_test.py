"""Checks the Prometheus endpoints of a running coordinator and its two workers (metrics_test.sh
starts them): real requests go through shardctl, both kinds of /metrics are scraped before and
after and parsed with prometheus_client's text parser, and every counter the requests move must
have moved by exactly the requests sent. Background traffic (heartbeats, registration) uses other
methods, so the methods checked here move only with our requests."""
import argparse
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

COORDINATOR = "/bertshard.v1.Coordinator/"
WORKER = "/bertshard.v1.Worker/"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Scrape:
    """One scrape of one endpoint: samples by (name, labels), family types by name."""

    def __init__(self, address):
        with urllib.request.urlopen("http://%s/metrics" % address, timeout=10) as answer:
            assert answer.status == 200, answer.status
            assert answer.headers["Content-Type"] == CONTENT_TYPE, answer.headers["Content-Type"]
            self.text = answer.read().decode("utf-8")
        self.samples = {}
        self.types = {}
        for family in text_string_to_metric_families(self.text):
            assert family.name not in self.types, "family %s twice" % family.name
            self.types[family.name] = family.type
            for s in family.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                assert key not in self.samples, "sample %s twice" % (key,)
                self.samples[key] = s.value
        self.check_histograms()

    def get(self, name, **labels):
        """The sample's value; 0 for a child not created yet (as Prometheus' rate() treats it)."""
        return self.samples.get((name, tuple(sorted(labels.items()))), 0.0)

    def children(self, name):
        return {labels: value for (n, labels), value in self.samples.items() if n == name}

    def check_histograms(self):
        # Buckets cumulative (non-decreasing in le), +Inf present and equal to _count.
        for family, kind in self.types.items():
            if kind != "histogram":
                continue
            buckets = {}
            for (name, labels), value in self.samples.items():
                if name == family + "_bucket":
                    rest = tuple(kv for kv in labels if kv[0] != "le")
                    buckets.setdefault(rest, []).append((float(dict(labels)["le"]), value))
            for rest, values in buckets.items():
                values.sort()
                assert values[-1][0] == float("inf"), (family, rest)
                counts = [v for _, v in values]
                assert counts == sorted(counts), (family, rest, values)
                assert values[-1][1] == self.get(family + "_count", **dict(rest)), (family, rest)


def delta(before, after, name, **labels):
    return after.get(name, **labels) - before.get(name, **labels)


def expect(actual, expected, what):
    if actual != expected:
        raise AssertionError("%s: expected %r, got %r" % (what, expected, actual))


def shardctl(args, binary, server, expect_ok=True):
    result = subprocess.run([binary] + args + ["--server", server], capture_output=True, text=True, timeout=300)
    if expect_ok and result.returncode != 0:
        raise AssertionError("shardctl %s failed (%d): %s" % (" ".join(args), result.returncode, result.stderr))
    if not expect_ok and result.returncode == 0:
        raise AssertionError("shardctl %s succeeded; a failure was expected" % " ".join(args))
    return result.stdout


def http_status(url, method):
    request = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, dict(answer.headers)
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shardctl", required=True)
    parser.add_argument("--server", required=True)
    parser.add_argument("--coordinator_metrics", required=True)
    parser.add_argument("--worker_metrics", required=True, help="comma-separated host:port, one per worker")
    parser.add_argument("--model", required=True)
    args = parser.parse_args()
    model = os.path.abspath(args.model)
    workers = args.worker_metrics.split(",")
    run = lambda command, **kw: shardctl(command, args.shardctl, args.server, **kw)

    # The workers-by-health gauge is the readiness check: both workers registered and healthy.
    deadline = time.time() + 30
    while Scrape(args.coordinator_metrics).get("bertshard_coordinator_workers", health="healthy") != 2:
        assert time.time() < deadline, Scrape(args.coordinator_metrics).text
        time.sleep(0.1)

    c0 = Scrape(args.coordinator_metrics)
    w0 = [Scrape(w) for w in workers]
    expect(c0.types.get("bertshard_grpc_requests"), "counter", "type of bertshard_grpc_requests_total")
    expect(c0.types.get("bertshard_grpc_request_duration_seconds"), "histogram", "type of the duration")
    expect(c0.types.get("bertshard_coordinator_jobs"), "gauge", "type of bertshard_coordinator_jobs")
    expect(w0[0].types.get("bertshard_worker_shards_loaded"), "gauge", "type of the shards gauge")
    for w in w0:
        expect(w.get("bertshard_worker_shards_loaded"), 0.0, "shards loaded before the submit")

    # One job over both workers (tp 2), watched until READY: SubmitJob once, WatchJob once, and one
    # LoadShard on each worker.
    job = run(["submit", "--checkpoint", model, "--tp", "2", "--watch"]).splitlines()[0].strip()
    c1 = Scrape(args.coordinator_metrics)
    w1 = [Scrape(w) for w in workers]
    expect(delta(c0, c1, "bertshard_grpc_requests_total", method=COORDINATOR + "SubmitJob", code="OK"), 1, "SubmitJob")
    expect(delta(c0, c1, "bertshard_grpc_requests_total", method=COORDINATOR + "WatchJob", code="OK"), 1, "WatchJob")
    expect(delta(c0, c1, "bertshard_grpc_request_duration_seconds_count", method=COORDINATOR + "SubmitJob"), 1,
           "SubmitJob duration samples")
    expect(c1.get("bertshard_coordinator_jobs", state="READY"), 1.0, "READY jobs")
    expect(c1.get("bertshard_coordinator_jobs", state="FAILED"), 0.0, "FAILED jobs")
    expect(c1.get("bertshard_coordinator_workers", health="healthy"), 2.0, "healthy workers")
    for i, (before, after) in enumerate(zip(w0, w1, strict=True)):
        expect(delta(before, after, "bertshard_grpc_requests_total", method=WORKER + "LoadShard", code="OK"), 1,
               "LoadShard on worker %d" % i)
        expect(after.get("bertshard_worker_shards_loaded"), 1.0, "shards loaded on worker %d" % i)

    # Which rank each worker holds, from its own metrics; each rank's bytes are the plan's param_bytes.
    plan = json.loads(run(["plan", "--checkpoint", model, "--tp", "2", "--output", "json"]))
    param_bytes = {int(r.get("rank", 0)): int(r["param_bytes"]) for r in plan["ranks"]}
    rank_of = []
    for i, w in enumerate(w1):
        loaded = w.children("bertshard_worker_loaded_bytes_total")
        expect(len(loaded), 1, "loaded-bytes children on worker %d" % i)
        (labels, value), = loaded.items()
        labels = dict(labels)
        expect(labels["job"], job, "job label on worker %d" % i)
        rank = int(labels["rank"])
        expect(value, float(param_bytes[rank]), "bytes loaded by rank %d" % rank)
        rank_of.append(rank)
    expect(sorted(rank_of), [0, 1], "ranks held by the two workers")

    # Known numbers of requests: Plan 3 OK (one above) + 2 refused, Infer 3 OK (2 rows each) + 1 on
    # a job that does not exist.
    for _ in range(2):
        run(["plan", "--checkpoint", model, "--tp", "2", "--output", "json"])
    for _ in range(2):
        run(["plan", "--checkpoint", model, "--tp", "3"], expect_ok=False)  # 3 does not divide 4 heads
    inputs = os.path.join(model, "input.json")
    rows = len(json.load(open(inputs))["input_ids"])
    for _ in range(3):
        run(["infer", job, "--input", inputs])
    run(["infer", "no-such-job", "--input", inputs], expect_ok=False)

    c2 = Scrape(args.coordinator_metrics)
    w2 = [Scrape(w) for w in workers]
    requests = lambda method, code: delta(c1, c2, "bertshard_grpc_requests_total", method=COORDINATOR + method,
                                          code=code)
    # The first Plan above ran between c1 and c2 too.
    expect(requests("Plan", "OK"), 3, "Plan OK")
    expect(requests("Plan", "INVALID_ARGUMENT"), 2, "Plan INVALID_ARGUMENT")
    expect(requests("Infer", "OK"), 3, "Infer OK")
    expect(requests("Infer", "NOT_FOUND"), 1, "Infer NOT_FOUND")
    expect(requests("SubmitJob", "OK"), 0, "SubmitJob after the submit")
    for method, calls in (("Plan", 5), ("Infer", 4)):
        expect(delta(c1, c2, "bertshard_grpc_request_duration_seconds_count", method=COORDINATOR + method), calls,
               "%s duration samples" % method)
        expect(delta(c1, c2, "bertshard_grpc_request_duration_seconds_bucket", method=COORDINATOR + method,
                     le="+Inf"), calls, "%s +Inf bucket" % method)
        assert delta(c1, c2, "bertshard_grpc_request_duration_seconds_sum", method=COORDINATOR + method) > 0
    expect(c2.get("bertshard_coordinator_jobs", state="READY"), 1.0, "READY jobs after the inferences")
    # Sequential calls each ran alone: three forwards of one request and `rows` rows.
    for family in ("requests", "rows", "tokens"):
        expect(c2.types.get("bertshard_coordinator_batch_" + family), "histogram", "type of the batch %s" % family)
    expect(delta(c1, c2, "bertshard_coordinator_batch_requests_count"), 3, "batched forwards")
    expect(delta(c1, c2, "bertshard_coordinator_batch_requests_sum"), 3, "requests over the batched forwards")
    expect(delta(c1, c2, "bertshard_coordinator_batch_requests_bucket", le="1"), 3, "forwards of one request")
    expect(delta(c1, c2, "bertshard_coordinator_batch_rows_sum"), 3 * rows, "rows over the batched forwards")
    # Recovery (issue 22): a job that never lost its group reads 0 restarts and not degraded, and
    # no group was lost.
    expect(c2.types.get("bertshard_coordinator_job_restarts"), "gauge", "type of the job restarts")
    expect(c2.types.get("bertshard_coordinator_job_degraded"), "gauge", "type of job degraded")
    expect(c2.types.get("bertshard_coordinator_groups_lost"), "counter", "type of groups lost")
    expect(c2.children("bertshard_coordinator_job_restarts").get((("job", job),)), 0.0, "restarts of the job")
    expect(c2.children("bertshard_coordinator_job_degraded").get((("job", job),)), 0.0, "degraded of the job")
    expect(c2.samples.get(("bertshard_coordinator_groups_lost_total", ())), 0.0, "groups lost")
    expect(c2.types.get("bertshard_coordinator_infer_queue_depth"), "gauge", "type of the queue depth")
    expect(c2.children("bertshard_coordinator_infer_queue_depth").get((("job", job),)), 0.0,
           "queue depth of the job (present) once every call returned")

    for i, (before, after) in enumerate(zip(w1, w2, strict=True)):
        labels = {"job": job, "rank": str(rank_of[i])}
        expect(delta(before, after, "bertshard_grpc_requests_total", method=WORKER + "Forward", code="OK"), 3,
               "Forward on worker %d" % i)
        expect(delta(before, after, "bertshard_grpc_request_duration_seconds_count", method=WORKER + "Forward"), 3,
               "Forward duration samples on worker %d" % i)
        expect(after.get("bertshard_worker_forward_duration_seconds_count", **labels), 3.0,
               "forward latency samples of rank %d" % rank_of[i])
        assert after.get("bertshard_worker_forward_duration_seconds_sum", **labels) > 0, after.text
        expect(after.get("bertshard_worker_forward_rows_count", **labels), 3.0, "batch sizes of rank %d" % rank_of[i])
        expect(after.get("bertshard_worker_forward_rows_sum", **labels), 3.0 * rows, "rows of rank %d" % rank_of[i])
        expect(after.get("bertshard_worker_forward_rows_bucket", le="1", **labels), 0.0, "forwards of <= 1 row")
        expect(after.get("bertshard_worker_forward_rows_bucket", le="2", **labels), 3.0, "forwards of <= 2 rows")
        expect(after.get("bertshard_worker_loaded_bytes_total", **labels),
               before.get("bertshard_worker_loaded_bytes_total", **labels), "bytes loaded after the inferences")

    # Only GET /metrics is served.
    for address in [args.coordinator_metrics] + workers:
        expect(http_status("http://%s/other" % address, "GET")[0], 404, "GET /other on %s" % address)
        status, headers = http_status("http://%s/metrics" % address, "POST")
        expect(status, 405, "POST /metrics on %s" % address)
        expect(headers.get("Allow"), "GET", "Allow header of the 405")
    # Once the job ends its series go, on the coordinator at once and on each worker with its
    # unload (sent in the background): /metrics follows the live jobs, not the history.
    run(["cancel", job])
    c3 = Scrape(args.coordinator_metrics)
    expect(c3.children("bertshard_coordinator_infer_queue_depth").get((("job", job),)), None,
           "queue depth of the cancelled job")
    expect(c3.get("bertshard_coordinator_jobs", state="CANCELLED"), 1.0, "CANCELLED jobs")
    for family in ("bertshard_coordinator_job_restarts", "bertshard_coordinator_job_degraded"):
        expect(c3.children(family).get((("job", job),)), None, "%s of the cancelled job" % family)
    deadline = time.time() + 30
    while any(job in Scrape(w).text for w in workers):
        assert time.time() < deadline, "a worker still exposes the cancelled job's series"
        time.sleep(0.1)
    print("metrics_test: OK (coordinator %s, workers %s, job %s)" % (args.coordinator_metrics, workers, job))


if __name__ == "__main__":
    sys.exit(main())
