"""KServe v2 through Triton's own client, unchanged (tests/kserve_clients_test.sh).

tritonclient.http against the /v2 routes and tritonclient.grpc against inference.GRPCInferenceService:
server and model metadata, readiness, infer with INT64 token ids and with BYTES text, every output
equal to what bertshard's gRPC Infer answers for the same input (`shardctl infer --output`).
"""
import argparse
import json
import os
import struct
import subprocess
import tempfile

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

ATOL = 1e-6  # the same forward on the same workers


def read_safetensors(path):
    with open(path, "rb") as f:
        blob = f.read()
    (size,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + size])
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        begin, end = meta["data_offsets"]
        dtype = {"F32": np.float32, "I64": np.int64}[meta["dtype"]]
        out[name] = np.frombuffer(blob[8 + size + begin:8 + size + end], dtype=dtype).reshape(meta["shape"])
    return out


class Checks:
    def __init__(self, args):
        self.shardctl = args.shardctl
        self.token_file = args.read_token_file
        with open(args.read_token_file) as f:
            self.headers = {"authorization": "Bearer " + f.read().strip()}
        self.http = httpclient.InferenceServerClient(args.http, network_timeout=120)
        self.grpc = grpcclient.InferenceServerClient(args.grpc)

    def auth(self):
        """A fresh headers dict per call: tritonclient.http adds its own header to the dict it is given."""
        return dict(self.headers)

    def grpc_infer(self, text):
        """bertshard.v1 Infer's outputs for `text` on the minilm job, and the ids it ran on."""
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "out.safetensors")
            subprocess.run([self.shardctl, "infer", "minilm", "--text", text, "--output", path,
                            "--token-file=" + self.token_file], check=True, capture_output=True)
            return read_safetensors(path)

    def metadata_and_readiness(self):
        for client in (self.http, self.grpc):
            assert client.is_server_live()
            assert client.is_server_ready(headers=self.auth())
            assert client.is_model_ready("minilm", headers=self.auth())
        server = self.http.get_server_metadata(headers=self.auth())
        assert server["name"] == "bertshard" and "binary_tensor_data" in server["extensions"], server
        assert self.grpc.get_server_metadata(headers=self.auth()).name == "bertshard"
        model = self.http.get_model_metadata("minilm", headers=self.auth())
        assert model["platform"] == "bertshard_BertModel" and model["versions"] == ["1"], model
        assert [o["name"] for o in model["outputs"]] == ["last_hidden_state", "pooler_output"], model
        assert model["outputs"][0]["shape"] == [-1, -1, 384], model
        g = self.grpc.get_model_metadata("minilm", headers=self.auth())
        assert [i.name for i in g.inputs][:3] == ["input_ids", "attention_mask", "token_type_ids"], g
        # Unknown models: not ready on both (as Triton answers); metadata 404 / NOT_FOUND.
        assert not self.http.is_model_ready("gpt-4", headers=self.auth())
        assert not self.grpc.is_model_ready("gpt-4", headers=self.auth())
        for call in (lambda: self.http.get_model_metadata("gpt-4", headers=self.auth()),
                     lambda: self.grpc.get_model_metadata("gpt-4", headers=self.auth())):
            try:
                call()
                raise AssertionError("an unknown model was described")
            except InferenceServerException as e:
                assert e.status() in ("404", "StatusCode.NOT_FOUND"), e.status()
        # Without the token: refused (health stays open).
        try:
            self.http.get_server_metadata()
            raise AssertionError("served without the token")
        except InferenceServerException as e:
            assert e.status() == "401", e.status()
        print("kserve_clients_test: metadata and readiness (tritonclient.http and .grpc)")

    def infer(self, module, client, inputs, outputs=None):
        return client.infer("minilm", inputs, outputs=outputs, headers=self.auth())

    def infer_ids_and_text(self):
        text = "What is Deep Learning?"
        reference = self.grpc_infer(text)
        ids = reference.get("input_ids")
        if ids is None:  # the ids it ran on, from /v2 itself: text with input_ids asked back
            t = httpclient.InferInput("text", [1], "BYTES")
            t.set_data_from_numpy(np.array([text.encode()], dtype=np.object_))
            got = self.http.infer("minilm", [t], outputs=[httpclient.InferRequestedOutput("input_ids")],
                                  headers=self.auth())
            ids = got.as_numpy("input_ids")
        ids = np.asarray(ids, dtype=np.int64)
        for module, client in ((httpclient, self.http), (grpcclient, self.grpc)):
            name = module.__name__
            by_ids = module.InferInput("input_ids", list(ids.shape), "INT64")
            by_ids.set_data_from_numpy(ids)
            by_text = module.InferInput("text", [1], "BYTES")
            by_text.set_data_from_numpy(np.array([text.encode()], dtype=np.object_))
            for label, inputs in (("INT64 ids", [by_ids]), ("BYTES text", [by_text])):
                result = self.infer(module, client, inputs)
                for output in ("last_hidden_state", "pooler_output"):
                    got = result.as_numpy(output)
                    want = reference[output]
                    assert got.dtype == np.float32 and got.shape == want.shape, (name, label, output, got.shape)
                    worst = float(np.max(np.abs(got - want)))
                    assert worst <= ATOL, (name, label, output, worst)
            # The request's outputs list: only pooler_output comes back.
            only = self.infer(module, client, [by_ids], outputs=[module.InferRequestedOutput("pooler_output")])
            assert only.as_numpy("last_hidden_state") is None and only.as_numpy("pooler_output") is not None
            print("kserve_clients_test: %s infer with INT64 ids and BYTES text equals Infer" % name)
        # JSON tensors (binary_data=False) give the same numbers.
        j = httpclient.InferInput("input_ids", list(ids.shape), "INT64")
        j.set_data_from_numpy(ids, binary_data=False)
        result = self.http.infer("minilm", [j], outputs=[httpclient.InferRequestedOutput("pooler_output", binary_data=False)],
                                 headers=self.auth())
        assert float(np.max(np.abs(result.as_numpy("pooler_output") - reference["pooler_output"]))) <= 1e-5

    def bad_input(self):
        for module, client in ((httpclient, self.http), (grpcclient, self.grpc)):
            wrong = module.InferInput("pixel_values", [1, 2], "INT64")
            wrong.set_data_from_numpy(np.array([[1, 2]], dtype=np.int64))
            floats = module.InferInput("input_ids", [1, 2], "FP32")
            floats.set_data_from_numpy(np.array([[1, 2]], dtype=np.float32))
            far = module.InferInput("input_ids", [1, 3], "INT64")
            far.set_data_from_numpy(np.array([[101, 10 ** 9, 102]], dtype=np.int64))
            for inputs, part in (([wrong], "unknown input"), ([floats], "FP32"), ([far], "vocab_size")):
                try:
                    client.infer("minilm", inputs, headers=self.auth())
                    raise AssertionError("bad input was served")
                except InferenceServerException as e:
                    assert e.status() in ("400", "StatusCode.INVALID_ARGUMENT"), (e.status(), e.message())
                    assert part in e.message(), e.message()
        assert self.http.is_model_ready("minilm", headers=self.auth())  # the job keeps serving
        print("kserve_clients_test: bad input refused (400 / INVALID_ARGUMENT), the job keeps serving")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--http", required=True)
    parser.add_argument("--grpc", required=True)
    parser.add_argument("--shardctl", required=True)
    parser.add_argument("--read_token_file", required=True)
    checks = Checks(parser.parse_args())
    checks.metadata_and_readiness()
    checks.infer_ids_and_text()
    checks.bad_input()


if __name__ == "__main__":
    main()
