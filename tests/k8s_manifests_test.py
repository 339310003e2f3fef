"""Checks the Kubernetes manifests in deploy/k8s (run by tests/k8s_manifests_test.sh).

For each kubectl given and each overlay (cpu, gpu, autoscale):
  1. `kubectl kustomize` renders it (every kubectl given renders the same documents, up to the
     order of the documents and the hash suffix of generated ConfigMap names);
  2. every document validates against the Kubernetes OpenAPI schemas, strictly (unknown fields are
     errors), with kubernetes-validate (pinned in tools/requirements-test.txt);
  3. checkov reports no failed check, and every skip it reports carries its reason;
  4. the manifests agree with the binaries and with each other: container args (and the flagfiles
     they name, from the ConfigMap) hold only flags the binaries list in --helpfull and that the
     binaries parse; probe, container and Service ports match --listen and --metrics_listen; the
     StatefulSet's serviceName is the headless Service; --advertise is the pod's stable DNS name;
     terminationGracePeriodSeconds exceeds --drain_timeout; the gpu overlay sets GPU limits and
     the cpu overlay none; the autoscale overlay's HPA sizes the worker StatefulSet by the external
     metric its prometheus-adapter rule makes of the coordinator's workers-wanted gauge
     (check_autoscale); and the rest listed in check_overlay().
Runs with the project venv's python (PyYAML comes with checkov).
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import yaml

# Kubernetes version whose OpenAPI schemas the documents are validated against: the newest that the
# pinned kubernetes-validate (1.31.0) bundles. Native gRPC probes need >= 1.24 (GA in 1.27).
KUBERNETES_VERSION = "1.31.0"
OVERLAYS = ("cpu", "gpu", "autoscale")
BINARY_FOR_COMMAND = {  # container command -> the flag used to pass the built binary to this test
    "/usr/local/bin/bertshard-coordinator": "coordinator",
    "/usr/local/bin/shard-worker": "worker",
}
GPU = "nvidia.com/gpu"

errors = []


def error(message):
    errors.append(message)
    print("FAIL: " + message, file=sys.stderr)


def check(condition, message):
    if not condition:
        error(message)
    return condition


def run(argv, **kwargs):
    return subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


# ----------------------------------------------------------------------------------------------
# Rendering


def render(kubectl, directory):
    result = run([kubectl, "kustomize", directory])
    for line in result.stderr.splitlines():
        print(f"  [{os.path.basename(kubectl)} stderr] {line}")
    if result.returncode != 0:
        error(f"{kubectl} kustomize {directory} exited {result.returncode}")
        return None, None
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    return result.stdout, docs


def generated_names(docs):
    """Names kustomize generated with a content-hash suffix (ConfigMaps, Secrets)."""
    return {d["metadata"]["name"] for d in docs
            if d["kind"] in ("ConfigMap", "Secret") and re.search(r"-[a-z0-9]{10}$", d["metadata"]["name"])}


def normalized(docs):
    """The documents, sorted, with generated names' hash suffixes (which differ between kustomize
    versions: both are content hashes, computed differently) replaced by HASH."""
    out = []
    names = generated_names(docs)
    for d in docs:
        text = json.dumps(d, sort_keys=True, indent=1)
        for name in names:
            text = text.replace(f'"{name}"', f'"{name[:-10]}HASH"')
        out.append(text)
    return sorted(out)


# ----------------------------------------------------------------------------------------------
# Validators


def validate(venv, path):
    argv = [os.path.join(venv, "bin", "kubernetes-validate"), "--strict", "--quiet",
            "--kubernetes-version", KUBERNETES_VERSION, path]
    result = run(argv)
    if result.returncode != 0:
        error(f"kubernetes-validate rejects {path}:\n{result.stdout}{result.stderr}")
    return result.returncode == 0


def validator_guard(venv, tmp, docs):
    """kubernetes-validate must reject what it should, or a pass means nothing: an unknown field
    and a wrong type in an otherwise valid StatefulSet."""
    sts = next(d for d in docs if d["kind"] == "StatefulSet")
    for name, mutate in (
        ("unknown field", lambda s: s["spec"].__setitem__("bogusField", 1)),
        ("wrong type", lambda s: s["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]
         .__setitem__("port", "not-a-number")),
    ):
        bad = json.loads(json.dumps(sts))
        mutate(bad)
        path = os.path.join(tmp, "bad.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(bad, f)
        result = run([os.path.join(venv, "bin", "kubernetes-validate"), "--strict", "--quiet",
                      "--kubernetes-version", KUBERNETES_VERSION, path])
        check(result.returncode != 0, f"kubernetes-validate accepts a StatefulSet with a {name}: it checks nothing")


def checkov(venv, path, tmp):
    argv = [os.path.join(venv, "bin", "checkov"), "--framework", "kubernetes", "--file", path,
            "--output", "json", "--skip-download", "--compact"]
    env = dict(os.environ, HOME=tmp, BC_SKIP_MAPPING="TRUE", LOG_LEVEL="WARNING")
    result = run(argv, env=env)
    try:
        report = json.loads(result.stdout)
    except json.JSONDecodeError:
        error(f"checkov on {path}: no JSON report (exit {result.returncode}):\n{result.stdout[-3000:]}\n"
              f"{result.stderr[-3000:]}")
        return
    reports = report if isinstance(report, list) else [report]
    passed, failed, skipped = [], [], []
    for r in reports:
        passed += r.get("results", {}).get("passed_checks", [])
        failed += r.get("results", {}).get("failed_checks", [])
        skipped += r.get("results", {}).get("skipped_checks", [])
    for c in failed:
        error(f"checkov {c['check_id']} ({c['check_name']}) fails for {c['resource']} in {os.path.basename(path)}")
    for c in skipped:
        reason = (c.get("check_result", {}) or {}).get("suppress_comment", "") or ""
        print(f"  checkov skip {c['check_id']} on {c['resource']}: {reason}")
        check(len(reason.strip()) >= 20, f"checkov skip {c['check_id']} on {c['resource']} gives no reason")
    resources = {c["resource"].split(".")[0] + "." + c["resource"].split(".")[-1] for c in passed}
    print(f"  checkov: {len(passed)} passed, {len(failed)} failed, {len(skipped)} skipped")
    check(len(passed) > 50 and any("StatefulSet" in r for r in resources) and any("Deployment" in r for r in resources),
          f"checkov scanned too little of {path} (passed {len(passed)}: {sorted(resources)})")
    check(result.returncode == 0 or failed, f"checkov exited {result.returncode}: {result.stderr[-2000:]}")


# ----------------------------------------------------------------------------------------------
# The binaries' flags


def binary_flags(binary):
    """Flag names the binary lists in --helpfull (absl: `    --name (help); default: ...;`)."""
    result = run([binary, "--helpfull"])
    names = set(re.findall(r"^\s+--([A-Za-z0-9_]+) \(", result.stdout + result.stderr, re.M))
    check("flagfile" in names and "listen" in names,
          f"{binary} --helpfull lists no usable flags (exit {result.returncode}): {result.stdout[:500]}")
    return names


def parse_duration_s(text):
    """absl::Duration text (e.g. 30s, 1m30s, 500ms, 1.5s) in seconds."""
    units = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1, "m": 60, "h": 3600}
    parts = re.findall(r"([0-9.]+)(ns|us|ms|s|m|h)", text)
    if not parts or "".join(a + b for a, b in parts) != text:
        raise ValueError(f"not a duration: {text}")
    return sum(float(a) * units[b] for a, b in parts)


def host_port(address):
    host, _, port = address.rpartition(":")
    return host, int(port)


# ----------------------------------------------------------------------------------------------
# One overlay's documents


def by_kind(docs, kind):
    return [d for d in docs if d["kind"] == kind]


def one(docs, kind, name):
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    check(len(found) == 1, f"expected one {kind} {name}, found {len(found)}")
    return found[0] if found else None


def selects(selector, labels):
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def container_flags(docs, pod_spec, container, overlay):
    """The container's flags, in order: those of each --flagfile (read from the ConfigMap volume
    it is mounted from) at its place, then the rest of the args. Returns [(name, value, where)]
    and the flagfiles' paths and texts."""
    mounts = {m["mountPath"].rstrip("/"): m["name"] for m in container.get("volumeMounts", [])}
    volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
    flags, files = [], {}
    for arg in container.get("args", []):
        m = re.fullmatch(r"--([A-Za-z0-9_]+)(?:=(.*))?", arg, re.S)
        if not check(m, f"{overlay}: {container['name']}: argument {arg!r} is not --flag[=value]"):
            continue
        name, value = m.group(1), m.group(2)
        flags.append((name, value, "args"))
        if name != "flagfile":
            continue
        directory, _, key = value.rpartition("/")
        volume = volumes.get(mounts.get(directory, ""), {})
        if not check("configMap" in volume,
                     f"{overlay}: {container['name']}: --flagfile={value} is not on a ConfigMap volume"):
            continue
        configmap = one(docs, "ConfigMap", volume["configMap"]["name"])
        text = (configmap or {}).get("data", {}).get(key)
        if not check(text is not None, f"{overlay}: ConfigMap {volume['configMap']['name']} has no key {key}"):
            continue
        files[value] = text
        for number, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            m = re.fullmatch(r"--([A-Za-z0-9_]+)=(.*)", line)
            if check(m, f"{overlay}: {key}:{number}: {line!r} is not --flag=value"):
                flags.append((m.group(1), m.group(2), key))
    return flags, files


def check_binary_parses(binary, flags_files, args, env, tmp, overlay, name):
    """The binary itself parses the container's flags: the flagfile as rendered, the args with
    $(VAR) expanded as the kubelet would, then --helpfull (so nothing is started). absl rejects an
    unknown flag or a malformed value before it prints the help."""
    argv = [binary]
    for arg in args:
        if arg.startswith("--flagfile="):
            path = os.path.join(tmp, f"{overlay}-{name}-{os.path.basename(arg.split('=', 1)[1])}")
            with open(path, "w") as f:
                f.write(flags_files[arg.split("=", 1)[1]])
            arg = "--flagfile=" + path
        argv.append(re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), arg))
    result = run(argv + ["--helpfull"])
    check("--listen" in result.stdout + result.stderr and "ERROR" not in result.stderr,
          f"{overlay}: {binary} does not parse the {name} container's flags {argv[1:]} "
          f"(exit {result.returncode}):\n{result.stderr[-2000:]}")


def check_workload(docs, overlay, workload, binaries, known_flags, tmp):
    kind, name = workload["kind"], workload["metadata"]["name"]
    pod = workload["spec"]["template"]
    spec = pod["spec"]
    labels = pod["metadata"].get("labels", {})
    check(selects(workload["spec"]["selector"]["matchLabels"], labels), f"{overlay}: {kind} {name}: selector misses its pods")
    pod_sc = spec.get("securityContext", {})
    check(pod_sc.get("runAsNonRoot") is True and pod_sc.get("runAsUser") == 10001 and pod_sc.get("runAsGroup") == 10001,
          f"{overlay}: {kind} {name}: pod not run as non-root uid/gid 10001")
    check(pod_sc.get("seccompProfile", {}).get("type") == "RuntimeDefault", f"{overlay}: {kind} {name}: no RuntimeDefault seccomp")
    check(spec.get("automountServiceAccountToken") is False, f"{overlay}: {kind} {name}: mounts a service account token")
    results = {}
    for c in spec["containers"]:
        where = f"{overlay}: {kind} {name}/{c['name']}"
        sc = c.get("securityContext", {})
        check(sc.get("readOnlyRootFilesystem") is True, f"{where}: root filesystem not read-only")
        check(sc.get("allowPrivilegeEscalation") is False, f"{where}: allows privilege escalation")
        check(sc.get("capabilities", {}).get("drop") == ["ALL"] and not sc.get("capabilities", {}).get("add"),
              f"{where}: capabilities not all dropped")
        res = c.get("resources", {})
        for part in ("requests", "limits"):
            for r in ("cpu", "memory"):
                check(r in res.get(part, {}), f"{where}: no {part}.{r}")
        command = (c.get("command") or [""])[0]
        if not check(command in BINARY_FOR_COMMAND, f"{where}: command {c.get('command')} is not a bertshard daemon"):
            continue
        role = BINARY_FOR_COMMAND[command]
        flags, files = container_flags(docs, spec, c, overlay)
        for flag, _, source in flags:
            check(flag in known_flags[role], f"{where}: --{flag} (in {source}) is not a flag of {os.path.basename(command)}")
        env = {e["name"]: e for e in c.get("env", [])}
        for arg in c.get("args", []):
            for var in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", arg):
                check(var in env, f"{where}: args use $({var}), which is not in env")
        sample_env = {"POD_NAME": f"{name}-0", "POD_NAMESPACE": workload["metadata"].get("namespace", "default")}
        for var, e in env.items():
            ref = e.get("valueFrom", {}).get("configMapKeyRef")
            if ref:
                cm = one(docs, "ConfigMap", ref["name"])
                check(cm is not None and ref["key"] in cm.get("data", {}), f"{where}: env {var}: no ConfigMap key {ref}")
                if cm is not None:
                    sample_env[var] = cm.get("data", {}).get(ref["key"], "")
        check_binary_parses(binaries[role], files, c.get("args", []), sample_env, tmp, overlay, c["name"])
        values = {}
        for flag, value, _ in flags:
            values[flag] = value  # the last one wins, as in absl
        results[role] = (workload, c, values, env)

        # Ports: --listen serves gRPC (and health), --metrics_listen serves /metrics.
        ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
        if check("listen" in values, f"{where}: no --listen"):
            _, listen = host_port(values["listen"])
            check(ports.get("grpc") == listen, f"{where}: containerPort grpc {ports.get('grpc')} != --listen port {listen}")
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                p = c.get(probe)
                if check(p and "grpc" in p, f"{where}: no native gRPC {probe}"):
                    check(p["grpc"].get("port") == listen, f"{where}: {probe} port {p['grpc'].get('port')} != --listen port {listen}")
                    check(p["grpc"].get("service", "") == "", f"{where}: {probe} asks for a service other than the server's overall health")
        if check("metrics_listen" in values, f"{where}: no --metrics_listen"):
            _, metrics = host_port(values["metrics_listen"])
            check(ports.get("metrics") == metrics, f"{where}: containerPort metrics {ports.get('metrics')} != --metrics_listen port {metrics}")
            ann = pod["metadata"].get("annotations", {})
            check(ann.get("prometheus.io/scrape") == "true" and ann.get("prometheus.io/port") == str(metrics)
                  and ann.get("prometheus.io/path") == "/metrics",
                  f"{where}: scrape annotations do not point at :{metrics}/metrics: {ann}")
        # The coordinator's HTTP API (--http_listen) has a containerPort named http on its port.
        if role == "coordinator" and check("http_listen" in values, f"{where}: no --http_listen"):
            _, http_port = host_port(values["http_listen"])
            check(ports.get("http") == http_port,
                  f"{where}: containerPort http {ports.get('http')} != --http_listen port {http_port}")
        drain = parse_duration_s(values.get("drain_timeout", "10s"))
        check(spec.get("terminationGracePeriodSeconds", 30) > drain,
              f"{where}: terminationGracePeriodSeconds {spec.get('terminationGracePeriodSeconds', 30)} <= --drain_timeout {drain}s")

        # The model: a read-only volume at /models, on every daemon (the coordinator reads config.json
        # and vocab.txt from the checkpoint path a job names, the workers the weights).
        mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        model = mounts.get("/models")
        if check(model and model.get("readOnly") is True, f"{where}: no read-only mount at /models"):
            claim = volumes.get(model["name"], {}).get("persistentVolumeClaim", {})
            check(claim.get("readOnly") is True and one(docs, "PersistentVolumeClaim", claim.get("claimName", "")),
                  f"{where}: /models is not a read-only PersistentVolumeClaim of these manifests")

        # GPUs: only in the gpu overlay, and there on every worker, which must also run on it
        # (--device=cuda:0; the default, cpu, registers it as a CPU worker and no nccl job is placed
        # on it). Elsewhere the device is the default or cpu.
        gpus = [res.get(part, {}).get(GPU) for part in ("requests", "limits") if GPU in res.get(part, {})]
        device = values.get("device", "cpu")
        if overlay == "gpu" and role == "worker":
            check(int(res.get("limits", {}).get(GPU, 0)) >= 1, f"{where}: no {GPU} limit in the gpu overlay")
            check(device == "cuda:0", f"{where}: --device is {device!r}, not cuda:0, in the gpu overlay")
            check(c.get("image", "").startswith("bertshard-cuda"), f"{where}: image {c.get('image')} is not bertshard-cuda")
        else:
            check(not gpus, f"{where}: {GPU} set in the {overlay} overlay")
            check(role != "worker" or device == "cpu", f"{where}: --device is {device!r} in the {overlay} overlay")
    return results


def service_port(service, name):
    return next((p for p in service["spec"].get("ports", []) if p.get("name") == name), None)


def target_port(port, container):
    t = port.get("targetPort", port["port"])
    if isinstance(t, str):
        t = next((p["containerPort"] for p in container.get("ports", []) if p.get("name") == t), None)
    return t


# The gauge the coordinator exports for a worker autoscaler (server/recovery_metrics.cc).
WORKERS_WANTED = "bertshard_coordinator_workers_wanted"


def check_autoscale(overlay, docs):
    """The autoscale overlay: one HPA on the rendered worker StatefulSet, whose external metric is the
    one the prometheus-adapter rule makes of the coordinator's workers-wanted gauge; none elsewhere."""
    hpas = by_kind(docs, "HorizontalPodAutoscaler")
    if overlay != "autoscale":
        check(not hpas, f"{overlay}: a HorizontalPodAutoscaler outside the autoscale overlay")
        return
    if not check(len(hpas) == 1, f"{overlay}: expected one HorizontalPodAutoscaler, found {len(hpas)}"):
        return
    hpa = hpas[0]
    workers = [d for d in by_kind(docs, "StatefulSet")]
    ref = hpa["spec"].get("scaleTargetRef", {})
    check(len(workers) == 1 and ref.get("kind") == "StatefulSet" and ref.get("apiVersion") == "apps/v1"
          and ref.get("name") == workers[0]["metadata"]["name"],
          f"{overlay}: the HPA's scaleTargetRef {ref} is not the worker StatefulSet")
    check(len(workers) == 1 and "replicas" not in workers[0]["spec"],
          f"{overlay}: the worker StatefulSet sets spec.replicas beside its HPA (each apply resets the pool)")
    check(hpa["metadata"].get("namespace") == workers[0]["metadata"].get("namespace"),
          f"{overlay}: the HPA is not in the workers' namespace")
    spec = hpa["spec"]
    check(1 <= spec.get("minReplicas", 1) <= spec.get("maxReplicas", 0), f"{overlay}: HPA min/max replicas out of order")
    down = spec.get("behavior", {}).get("scaleDown", {})
    check(down.get("stabilizationWindowSeconds", 0) >= 300,
          f"{overlay}: the HPA scales down within 5 minutes of a dip (a replica being placed again)")
    metrics = spec.get("metrics", [])
    names = [m["external"]["metric"]["name"] for m in metrics if m.get("type") == "External"]
    targets = [m["external"]["target"] for m in metrics if m.get("type") == "External"]
    check(len(names) == 1 and len(metrics) == 1, f"{overlay}: the HPA should have one External metric, has {metrics}")
    check(all(t.get("type") == "AverageValue" and str(t.get("averageValue")) == "1" for t in targets),
          f"{overlay}: the HPA target is not AverageValue 1 per pod (the pool would not track the want)")
    rules = []
    for cm in by_kind(docs, "ConfigMap"):
        config = cm.get("data", {}).get("config.yaml")
        if config:
            rules += (yaml.safe_load(config) or {}).get("externalRules", [])
    if not check(rules, f"{overlay}: no prometheus-adapter externalRules ConfigMap"):
        return
    made = {}
    for r in rules:
        name = r.get("name", {})
        made[name.get("as") or WORKERS_WANTED] = r
    for n in names:
        rule = made.get(n)
        if check(rule is not None, f"{overlay}: the HPA's metric {n} is no prometheus-adapter rule's name ({sorted(made)})"):
            check(WORKERS_WANTED in rule.get("seriesQuery", "") and WORKERS_WANTED in rule.get("name", {}).get("matches", ""),
                  f"{overlay}: the adapter rule for {n} does not read {WORKERS_WANTED}")


def check_overlay(overlay, docs, binaries, known_flags, tmp):
    check_autoscale(overlay, docs)
    workloads = by_kind(docs, "Deployment") + by_kind(docs, "StatefulSet")
    roles = {}
    for w in workloads:
        roles.update(check_workload(docs, overlay, w, binaries, known_flags, tmp))
    if not check("coordinator" in roles and "worker" in roles, f"{overlay}: needs a coordinator and a worker workload"):
        return
    coord, coord_c, coord_flags, _ = roles["coordinator"]
    worker, worker_c, worker_flags, worker_env = roles["worker"]
    _, coord_listen = host_port(coord_flags["listen"])
    _, worker_listen = host_port(worker_flags["listen"])
    services = by_kind(docs, "Service")

    # Coordinator: one replica, Recreate, its data dir on a PersistentVolumeClaim; a Service with the
    # gRPC port (appProtocol grpc) and the metrics port.
    check(coord["kind"] == "Deployment" and coord["spec"].get("replicas") == 1
          and coord["spec"].get("strategy", {}).get("type") == "Recreate",
          f"{overlay}: the coordinator is not a 1-replica Deployment with strategy Recreate")
    data_dir = coord_flags.get("data_dir", "")
    data_mount = next((m for m in coord_c.get("volumeMounts", []) if m["mountPath"].rstrip("/") == data_dir.rstrip("/")), None)
    if check(data_mount, f"{overlay}: nothing mounted at --data_dir={data_dir}"):
        vol = next(v for v in coord["spec"]["template"]["spec"]["volumes"] if v["name"] == data_mount["name"])
        check("persistentVolumeClaim" in vol and not data_mount.get("readOnly"),
              f"{overlay}: --data_dir is not on a writable PersistentVolumeClaim")
    coord_labels = coord["spec"]["template"]["metadata"]["labels"]
    coord_svcs = [s for s in services if selects(s["spec"].get("selector"), coord_labels)]
    if check(len(coord_svcs) == 1, f"{overlay}: expected one Service for the coordinator, found {len(coord_svcs)}"):
        svc = coord_svcs[0]
        grpc = service_port(svc, "grpc")
        metrics = service_port(svc, "metrics")
        if check(grpc and metrics, f"{overlay}: coordinator Service lacks a grpc or a metrics port"):
            check(target_port(grpc, coord_c) == coord_listen, f"{overlay}: coordinator Service grpc targetPort != --listen port")
            check(grpc.get("appProtocol") == "grpc", f"{overlay}: coordinator Service grpc port has no appProtocol: grpc")
            check(target_port(metrics, coord_c) == host_port(coord_flags["metrics_listen"])[1],
                  f"{overlay}: coordinator Service metrics targetPort != --metrics_listen port")
            http = service_port(svc, "http")
            check(http and "http_listen" in coord_flags
                  and target_port(http, coord_c) == host_port(coord_flags["http_listen"])[1],
                  f"{overlay}: coordinator Service has no http port to --http_listen's")
            # Workers reach the coordinator through this Service, by DNS name.
            host, port = host_port(worker_flags.get("coordinator", ":0"))
            check(host.split(".")[0] == svc["metadata"]["name"] and port == grpc["port"],
                  f"{overlay}: worker --coordinator={worker_flags.get('coordinator')} is not Service "
                  f"{svc['metadata']['name']}:{grpc['port']}")

    # Workers: a StatefulSet (Parallel) whose serviceName is a headless Service selecting its pods;
    # each advertises its stable DNS name, from the downward API, on its --listen port.
    check(worker["kind"] == "StatefulSet" and worker["spec"].get("podManagementPolicy") == "Parallel",
          f"{overlay}: the workers are not a StatefulSet with podManagementPolicy Parallel")
    svc_name = worker["spec"].get("serviceName")
    headless = next((s for s in services if s["metadata"]["name"] == svc_name), None)
    worker_labels = worker["spec"]["template"]["metadata"]["labels"]
    if check(headless, f"{overlay}: StatefulSet serviceName {svc_name} names no Service"):
        check(headless["spec"].get("clusterIP") == "None", f"{overlay}: Service {svc_name} is not headless")
        check(selects(headless["spec"].get("selector"), worker_labels), f"{overlay}: Service {svc_name} does not select the workers")
        grpc = service_port(headless, "grpc")
        check(grpc and target_port(grpc, worker_c) == worker_listen and grpc.get("appProtocol") == "grpc",
              f"{overlay}: headless Service grpc port does not match the worker's --listen")
        metrics = service_port(headless, "metrics")
        check(metrics and target_port(metrics, worker_c) == host_port(worker_flags["metrics_listen"])[1],
              f"{overlay}: headless Service metrics port does not match the worker's --metrics_listen")
    advertise = worker_flags.get("advertise", "")
    check(advertise == f"$(POD_NAME).{svc_name}.$(POD_NAMESPACE).svc.$(CLUSTER_DOMAIN):{worker_listen}",
          f"{overlay}: worker --advertise={advertise} is not the pod's stable name on the --listen port")
    for var, path in (("POD_NAME", "metadata.name"), ("POD_NAMESPACE", "metadata.namespace")):
        check(worker_env.get(var, {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == path,
              f"{overlay}: worker env {var} is not the downward API's {path}")

    # Disruption budget over the workers.
    check(any(selects(p["spec"]["selector"].get("matchLabels"), worker_labels) for p in by_kind(docs, "PodDisruptionBudget")),
          f"{overlay}: no PodDisruptionBudget selects the workers")

    # Network policies: clients -> coordinator gRPC, coordinator -> worker gRPC, worker <-> worker on
    # every TCP port (rendezvous, collectives), worker -> coordinator gRPC.
    policies = by_kind(docs, "NetworkPolicy")

    def allows(direction, pod_labels, peer_labels, port):
        """Some policy selecting pod_labels allows `direction` traffic with peer_labels on port
        (None: a rule that must allow every TCP port). peer_labels None: from/to anywhere; "scrapers":
        from anywhere or from pods of other namespaces."""
        for p in policies:
            if not (p["spec"]["podSelector"] == {} or selects(p["spec"]["podSelector"].get("matchLabels"), pod_labels)):
                continue
            for rule in p["spec"].get(direction, []):
                peers = rule.get("from" if direction == "ingress" else "to")
                if peers is not None and peer_labels == "scrapers":
                    # Prometheus runs in some other namespace: a namespaceSelector peer.
                    if not any("namespaceSelector" in x for x in peers):
                        continue
                elif peers is not None:
                    if peer_labels is None:
                        continue
                    if not any(set(x) == {"podSelector"} and selects(x["podSelector"].get("matchLabels"), peer_labels) for x in peers):
                        continue
                rule_ports = rule.get("ports")
                if rule_ports is None:
                    return True
                for rp in rule_ports:
                    if rp.get("protocol", "TCP") != "TCP":
                        continue
                    if "port" not in rp or (port is not None and rp["port"] == port):
                        return True
        return False

    check(allows("ingress", coord_labels, None, coord_listen), f"{overlay}: no NetworkPolicy lets clients reach the coordinator's port {coord_listen}")
    check(allows("ingress", worker_labels, coord_labels, worker_listen), f"{overlay}: coordinator -> worker:{worker_listen} not allowed in")
    check(allows("egress", coord_labels, worker_labels, worker_listen), f"{overlay}: coordinator -> worker:{worker_listen} not allowed out")
    check(allows("egress", worker_labels, coord_labels, coord_listen), f"{overlay}: worker -> coordinator:{coord_listen} not allowed out")
    check(allows("ingress", worker_labels, worker_labels, None), f"{overlay}: worker <-> worker (every TCP port) not allowed in")
    check(allows("egress", worker_labels, worker_labels, None), f"{overlay}: worker <-> worker (every TCP port) not allowed out")
    for labels, flags, who in ((coord_labels, coord_flags, "coordinator"), (worker_labels, worker_flags, "worker")):
        port = host_port(flags["metrics_listen"])[1]
        check(allows("ingress", labels, "scrapers", port), f"{overlay}: no NetworkPolicy lets scrapers reach the {who}'s metrics port {port}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--manifests", required=True)
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--worker", required=True)
    parser.add_argument("--venv", required=True)
    parser.add_argument("kubectls", nargs="+")
    args = parser.parse_args()
    tmp = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
    # A real copy: kustomize refuses files that resolve (runfiles symlinks) outside its root.
    root = os.path.join(tmp, "k8s")
    shutil.copytree(args.manifests, root, symlinks=False)

    binaries = {"coordinator": os.path.abspath(args.coordinator), "worker": os.path.abspath(args.worker)}
    known_flags = {role: binary_flags(path) for role, path in binaries.items()}

    worker_args = {}  # overlay -> the worker container's args, as first rendered
    for overlay in OVERLAYS:
        renders = {}
        for kubectl in args.kubectls:
            version = run([kubectl, "version", "--client"]).stdout.strip().replace("\n", " ")
            print(f"== {overlay}: {kubectl} ({version})")
            text, docs = render(kubectl, os.path.join(root, "overlays", overlay))
            if docs is None:
                continue
            renders[kubectl] = docs
            path = os.path.join(tmp, f"{overlay}-{len(renders)}.yaml")
            with open(path, "w") as f:
                f.write(text)
            print(f"  {len(docs)} documents: " + ", ".join(f"{d['kind']}/{d['metadata']['name']}" for d in docs))
            if validate(args.venv, path):
                print(f"  kubernetes-validate --strict ({KUBERNETES_VERSION}): all valid")
            checkov(args.venv, path, tmp)
            check_overlay(overlay, docs, binaries, known_flags, tmp)
            for d in docs:
                if d.get("kind") == "StatefulSet":
                    for c in d["spec"]["template"]["spec"].get("containers", []):
                        if c.get("name") == "worker":
                            worker_args.setdefault(overlay, c.get("args", []))
        if renders:
            first = args.kubectls[0]
            for kubectl, docs in renders.items():
                if kubectl != first and first in renders and normalized(docs) != normalized(renders[first]):
                    import difflib
                    diff = "\n".join(difflib.unified_diff("\n".join(normalized(renders[first])).splitlines(),
                                                          "\n".join(normalized(docs)).splitlines(), first, kubectl, lineterm=""))
                    error(f"{overlay}: {kubectl} renders differently from {first}:\n{diff[:5000]}")
    # An overlay that sets the worker's args replaces the base's list whole (a strategic merge of a
    # list of strings): each must keep every arg the cpu overlay (the base's) has, so that an arg
    # added to the base later is not silently dropped there.
    for overlay, got in worker_args.items():
        missing = [a for a in worker_args.get("cpu", []) if a not in got]
        check(not missing, f"{overlay}: the worker's args lack the base's {missing}")
    some = next(iter(renders.values()), None) if renders else None
    if some:
        validator_guard(args.venv, tmp, some)

    if errors:
        print(f"\n{len(errors)} problem(s):\n- " + "\n- ".join(errors), file=sys.stderr)
        return 1
    print("\nPASSED: k8s manifests render, validate, pass checkov and match the binaries")
    return 0


if __name__ == "__main__":
    sys.exit(main())
