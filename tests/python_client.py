#!/usr/bin/python3
"""A client bertshard did not write: Debian's python3-grpcio with stubs that python3-grpc-tools
generated from our protos (see python_client_test.sh). Talks to a running coordinator with two
workers: Plan (valid and invalid), the standard health service, server reflection, and a job
submitted, watched to READY and asked for an inference, checked against the reference outputs."""
import json
import os
import struct
import sys
import time

import grpc

from bertshard.v1 import coordinator_pb2, coordinator_pb2_grpc, job_pb2, plan_pb2, worker_pb2
from stdproto import health_pb2, health_pb2_grpc, reflection_pb2, reflection_pb2_grpc

MODEL = os.path.abspath("tests/testdata/model/masked_lm_untied")


def read_safetensors(path):
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        out[name] = (info["shape"], struct.unpack("<%df" % ((end - begin) // 4), data[begin:end]))
    return out


def submit_and_infer(coordinator):
    deadline = time.time() + 30
    while len([w for w in coordinator.ListWorkers(coordinator_pb2.ListWorkersRequest(), timeout=10).workers
               if w.healthy]) < 2:
        assert time.time() < deadline, "workers did not register"
        time.sleep(0.1)
    submit = coordinator_pb2.SubmitJobRequest()
    submit.request.checkpoint = MODEL
    submit.request.parallel.tp_size = 2
    job = coordinator.SubmitJob(submit, timeout=30)
    last = None
    for event in coordinator.WatchJob(coordinator_pb2.GetJobRequest(job_id=job.id), timeout=120):
        last = event
    assert last.job.state == job_pb2.READY, last.job.failure_cause

    inputs = json.load(open(os.path.join(MODEL, "input.json")))
    tokens = worker_pb2.TokenInputs(rows=len(inputs["input_ids"]), seq=len(inputs["input_ids"][0]), choices=1)
    for key in ("input_ids", "attention_mask", "token_type_ids"):
        getattr(tokens, key).extend(v for row in inputs[key] for v in row)
    answer = coordinator.Infer(coordinator_pb2.InferRequest(job_id=job.id, tokens=tokens), timeout=120)
    shape, expected = read_safetensors(os.path.join(MODEL, "expected.safetensors"))["logits"]
    (logits,) = answer.outputs
    assert logits.name == "logits" and list(logits.shape) == shape, (logits.name, logits.shape)
    # strict: a short answer must fail, not compare only its first values (runs under /usr/bin/python3, 3.11).
    worst = max(abs(a - b) for a, b in zip(logits.values, expected, strict=True))
    assert worst <= 1e-5, worst

    try:
        coordinator.Infer(coordinator_pb2.InferRequest(job_id="no-such-job", tokens=tokens), timeout=10)
        raise AssertionError("an unknown job was served")
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.NOT_FOUND, e.code()
    coordinator.CancelJob(coordinator_pb2.GetJobRequest(job_id=job.id), timeout=30)


def main(address):
    channel = grpc.insecure_channel(address)
    grpc.channel_ready_future(channel).result(timeout=10)

    coordinator = coordinator_pb2_grpc.CoordinatorStub(channel)
    request = plan_pb2.PlanRequest(variant=plan_pb2.BERT_FOR_MASKED_LM)
    request.config.num_hidden_layers = 4
    request.parallel.tp_size = 2
    request.parallel.pp_size = 2
    request.parallel.pp_style = plan_pb2.INTERLEAVED
    plan = coordinator.Plan(request, timeout=10)
    assert list(plan.layers_per_stage) == [1, 1, 1, 1], plan.layers_per_stage
    assert len(plan.ranks) == 4 and plan.ranks[3].param_bytes > 0
    assert plan.stages[1].held_modules[-1] == "cls", plan.stages[1].held_modules
    assert plan.config.vocab_size == 30522 and plan.config.HasField("tie_word_embeddings")

    request.parallel.tp_size = 5
    try:
        coordinator.Plan(request, timeout=10)
        raise AssertionError("tp_size 5 was accepted")
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e.code()
        assert "valid tp_size values: 1, 2, 3, 4, 6, 12" in e.details(), e.details()

    health = health_pb2_grpc.HealthStub(channel)
    status = health.Check(health_pb2.HealthCheckRequest(), timeout=10).status
    assert status == health_pb2.HealthCheckResponse.SERVING, status

    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    responses = reflection.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services=""),
              reflection_pb2.ServerReflectionRequest(file_containing_symbol="bertshard.v1.Coordinator"),
              reflection_pb2.ServerReflectionRequest(file_containing_symbol="grpc.health.v1.Health")]),
        timeout=10)
    listed, *described = list(responses)
    names = {s.name for s in listed.list_services_response.service}
    assert {"bertshard.v1.Coordinator", "grpc.health.v1.Health"} <= names, names
    for d in described:  # grpcurl-style clients can describe both services
        assert len(d.file_descriptor_response.file_descriptor_proto) > 0, d
    submit_and_infer(coordinator)
    print("python client: plan, invalid argument, health, reflection, submit, infer ok")


if __name__ == "__main__":
    main(sys.argv[1])
