#!/usr/bin/python3
"""A client bertshard did not write: Debian's python3-grpcio with stubs that python3-grpc-tools
generated from our protos (see python_client_test.sh). Talks to a running coordinator:
Plan (valid and invalid), the standard health service, and server reflection."""
import sys

import grpc

from bertshard.v1 import coordinator_pb2_grpc, plan_pb2
from stdproto import health_pb2, health_pb2_grpc, reflection_pb2, reflection_pb2_grpc


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
    print("python client: plan, invalid argument, health, reflection ok")


if __name__ == "__main__":
    main(sys.argv[1])
