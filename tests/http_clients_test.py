"""The coordinator's HTTP routes through clients we did not write (tests/http_clients_test.sh).

OpenAI's SDK against /v1 and `requests` against TEI's routes; every embedding is compared with
what the gRPC Embed answers for the same input (`shardctl embed --format json`).
"""
import argparse
import base64
import glob
import json
import math
import os
import struct
import subprocess
import threading
import time

import openai
import requests

ATOL = 1e-6  # the same forward on the same workers: only float printing may differ


def close(a, b, atol=ATOL):
    assert len(a) == len(b), (len(a), len(b))
    worst = max(abs(x - y) for x, y in zip(a, b))
    assert worst <= atol, "max abs diff %g > %g" % (worst, atol)


def norm(v):
    return math.sqrt(sum(x * x for x in v))


class Checks:
    def __init__(self, args):
        self.base = "http://" + args.http
        self.shardctl = args.shardctl
        self.token_file = args.read_token_file
        with open(args.read_token_file) as f:
            self.token = f.read().strip()
        self.fault_dir = args.fault_dir
        self.auth = {"Authorization": "Bearer " + self.token}
        self.client = openai.OpenAI(api_key=self.token, base_url=self.base + "/v1", max_retries=0, timeout=60)

    def grpc_embed(self, texts):
        """The gRPC Embed's vectors for `texts` on the minilm job."""
        out = subprocess.run([self.shardctl, "embed", "minilm", *texts, "--format=json",
                              "--token-file=" + self.token_file], check=True, capture_output=True, text=True)
        return [e["values"] for e in json.loads(out.stdout)["embeddings"]]

    def post(self, path, body, headers=None, data=None):
        return requests.post(self.base + path, json=body if data is None else None, data=data,
                             headers=self.auth if headers is None else headers, timeout=60)

    def tei_error(self, answer, status, error_type, part=""):
        assert answer.status_code == status, (answer.status_code, answer.text)
        body = answer.json()
        assert set(body) == {"error", "error_type"}, body
        assert body["error_type"] == error_type, body
        assert part in body["error"], body

    def openai_embeddings(self):
        texts = ["What is Deep Learning?", "the cat sat on the mat"]
        reference = self.grpc_embed(texts)
        floats = self.client.embeddings.create(model="minilm", input=texts, encoding_format="float")
        assert floats.model == "minilm" and floats.object == "list", floats
        assert [d.index for d in floats.data] == [0, 1]
        for got, want in zip(floats.data, reference):
            close(got.embedding, want)
        assert floats.usage.prompt_tokens > 4 and floats.usage.total_tokens == floats.usage.prompt_tokens
        # base64: the raw little-endian float32 bytes, decoded here by hand.
        b64 = self.client.embeddings.create(model="minilm", input=texts[0], encoding_format="base64")
        raw = base64.b64decode(b64.data[0].embedding)
        close(list(struct.unpack("<%df" % (len(raw) // 4), raw)), reference[0])
        # The SDK's default asks for base64 and decodes it itself.
        default = self.client.embeddings.create(model="minilm", input=texts[0])
        close(default.data[0].embedding, reference[0])
        # Matryoshka: the first 128 values, normalised again.
        cut = self.client.embeddings.create(model="minilm", input=texts[0], dimensions=128, encoding_format="float")
        head = reference[0][:128]
        close(cut.data[0].embedding, [x / norm(head) for x in head])
        # Token ids as input: the ids /tokenize gives for the text embed as the text does.
        ids = [t["id"] for t in self.post("/tokenize", {"inputs": texts[1]}).json()[0]]
        by_ids = self.client.embeddings.create(model="minilm", input=[ids], encoding_format="float")
        close(by_ids.data[0].embedding, reference[1])
        # No model named: --default_job.
        close(self.client.embeddings.create(model="", input=texts[0], encoding_format="float").data[0].embedding,
              reference[0])
        print("http_clients_test: openai embeddings (float, base64, dimensions, token ids) equal gRPC Embed")

    def openai_errors(self):
        wrong = openai.OpenAI(api_key="sk-wrong", base_url=self.base + "/v1", max_retries=0, timeout=60)
        for call in (lambda: wrong.embeddings.create(model="minilm", input="x"), lambda: wrong.models.list()):
            try:
                call()
                raise AssertionError("a wrong key was accepted")
            except openai.AuthenticationError as e:
                assert e.status_code == 401 and e.code == "invalid_api_key", e
        try:
            self.client.embeddings.create(model="gpt-4", input="x")
            raise AssertionError("an unknown model was served")
        except openai.NotFoundError as e:
            assert e.code == "model_not_found", e
        try:
            self.client.embeddings.create(model="minilm", input="")
            raise AssertionError("an empty input was served")
        except openai.BadRequestError as e:
            assert e.status_code == 400, e
        models = sorted(m.id for m in self.client.models.list())
        assert models == ["minilm", "reranker", "sentiment"], models
        assert self.client.models.retrieve("sentiment").owned_by == "bertshard"
        print("http_clients_test: openai errors (AuthenticationError, NotFoundError, BadRequestError), models.list")

    def tei_routes(self):
        text = "What is Deep Learning?"
        reference = self.grpc_embed([text])[0]
        answer = self.post("/embed", {"inputs": text})
        assert answer.status_code == 200, answer.text
        close(answer.json()[0], reference)
        for header in ("x-compute-time", "x-total-time", "x-tokenization-time", "x-queue-time", "x-inference-time",
                       "x-compute-tokens", "x-compute-characters"):
            assert answer.headers[header].isdigit(), (header, answer.headers)
        assert answer.headers["x-compute-characters"] == str(len(text))
        batch = self.post("/embed", {"inputs": [text, "b"], "normalize": False})
        assert batch.status_code == 200 and len(batch.json()) == 2, batch.text
        assert abs(norm(batch.json()[0]) - 1) > 1e-3  # unnormalised
        cut = self.post("/embed", {"inputs": text, "dimensions": 64}).json()[0]
        assert len(cut) == 64 and abs(norm(cut) - 1) < 1e-5
        # Truncation: a text over the 256-token maximum, cut from the end (Right, the default) or the
        # start (Left), embeds as the tokens that were kept (254 words between [CLS] and [SEP]).
        long_text = "alpha " + "word " * 400
        for direction, kept in (("Right", "alpha " + "word " * 253), ("Left", "word " * 254)):
            cut = self.post("/embed", {"inputs": long_text, "truncate": True, "truncation_direction": direction})
            assert cut.status_code == 200, cut.text
            close(cut.json()[0], self.post("/embed", {"inputs": kept}).json()[0], atol=1e-5)
        # Prompts: /embed, /embed_all and /tokenize see "query: " + the text, as if it had been sent.
        prompted = "query: " + text
        for route in ("/embed", "/embed_all", "/tokenize"):
            named = self.post(route, {"inputs": text, "prompt_name": "query"})
            plain = self.post(route, {"inputs": prompted})
            assert named.status_code == 200 and plain.status_code == 200, (route, named.text, plain.text)
            if route == "/tokenize":
                assert named.json() == plain.json(), (named.json(), plain.json())
                assert [t["text"] for t in named.json()[0][1:4]] == ["query", ":", "what"], named.json()
            else:
                close(sum(named.json(), []) if route == "/embed" else sum(named.json()[0], []),
                      sum(plain.json(), []) if route == "/embed" else sum(plain.json()[0], []), atol=1e-5)
        self.tei_error(self.post("/embed_all", {"inputs": text, "prompt_name": "nope"}), 422, "Validation", "nope")
        self.tei_error(self.post("/tokenize", {"inputs": text, "prompt_name": "nope"}), 422, "Validation", "nope")
        tokens = self.post("/tokenize", {"inputs": "hello world"})
        assert tokens.status_code == 200, tokens.text
        pieces = tokens.json()[0]
        assert [p["special"] for p in pieces] == [True, False, False, True], pieces
        assert {"id", "text", "special", "start", "stop"} == set(pieces[0]), pieces
        decoded = self.post("/decode", {"ids": [p["id"] for p in pieces]})
        assert decoded.json() == ["hello world"], decoded.text
        every = self.post("/embed_all", {"inputs": "hello world"})
        assert every.status_code == 200, every.text
        assert len(every.json()[0]) == 4 and len(every.json()[0][0]) == 384
        predicted = self.post("/predict", {"inputs": "w5 w6 w7", "model": "sentiment"})
        assert predicted.status_code == 200, predicted.text
        labels = predicted.json()
        assert [set(p) for p in labels] == [{"score", "label"}] * 3, labels
        assert sorted(p["label"] for p in labels) == ["LABEL_0", "LABEL_1", "LABEL_2"]
        assert labels == sorted(labels, key=lambda p: -p["score"]) and abs(sum(p["score"] for p in labels) - 1) < 1e-5
        pairs = self.post("/predict", {"inputs": [["w5", "w6"], ["w7"]], "model": "sentiment"})
        assert pairs.status_code == 200 and len(pairs.json()) == 2, pairs.text
        texts = ["deep learning is a kind of machine learning", "the cat sat on the mat", "neural networks"]
        query = "what is deep learning?"
        ranked = self.post("/rerank", {"query": query, "texts": texts, "return_text": True, "model": "reranker"})
        assert ranked.status_code == 200, ranked.text
        ranks = ranked.json()
        assert sorted(r["index"] for r in ranks) == [0, 1, 2] and ranks == sorted(ranks, key=lambda r: -r["score"])
        assert all(r["text"] == texts[r["index"]] for r in ranks), ranks
        # The same pairs through /predict's raw logits: rerank's scores are their sigmoids.
        logits = self.post("/predict", {"inputs": [[query, t] for t in texts], "raw_scores": True, "model": "reranker"})
        assert logits.status_code == 200, logits.text
        for r in ranks:
            logit = logits.json()[r["index"]][0]["score"]
            assert abs(r["score"] - 1 / (1 + math.exp(-logit))) < 1e-6, (r, logit)
        # The gRPC Rerank (shardctl rerank) ranks the same pairs in the same order, with the same scores.
        out = subprocess.run([self.shardctl, "rerank", "reranker", "--query", query, *texts, "--format=json",
                              "--token-file=" + self.token_file], check=True, capture_output=True, text=True)
        grpc_ranks = json.loads(out.stdout)["results"]
        assert [g.get("index", 0) for g in grpc_ranks] == [r["index"] for r in ranks], (grpc_ranks, ranks)
        for g, r in zip(grpc_ranks, ranks):
            assert abs(g.get("score", 0.0) - r["score"]) < 1e-6, (g, r)
        refused = subprocess.run([self.shardctl, "rerank", "sentiment", "--query", query, *texts,
                                  "--token-file=" + self.token_file], capture_output=True, text=True)
        assert refused.returncode == 1 and "with one label" in refused.stderr, (refused.returncode, refused.stderr)
        self.tei_error(self.post("/rerank", {"query": query, "texts": texts, "model": "sentiment"}), 424, "Backend",
                       "re-ranker")
        similar = self.post("/similarity", {"inputs": {"source_sentence": text, "sentences": ["b", text]}})
        assert similar.status_code == 200, similar.text
        unit = [self.post("/embed", {"inputs": t}).json()[0] for t in (text, "b")]
        close(similar.json(), [sum(x * y for x, y in zip(unit[0], unit[1])), 1.0], atol=1e-5)
        info = requests.get(self.base + "/info", headers=self.auth, timeout=30).json()
        assert info["model_id"] == "minilm" and info["model_type"] == {"embedding": {"pooling": "mean"}}, info
        assert info["max_client_batch_size"] == 4 and info["max_concurrent_requests"] == 1, info
        assert requests.get(self.base + "/health", timeout=30).status_code == 200
        print("http_clients_test: TEI routes /embed /embed_all /predict /rerank /similarity /tokenize /decode /info /health;"
              " gRPC Rerank equal to /rerank")

    def tei_errors(self):
        self.tei_error(self.post("/embed", {"inputs": []}), 400, "Empty", "`inputs` cannot be empty")
        self.tei_error(self.post("/embed", {"inputs": ""}), 400, "Empty", "`inputs` cannot be empty")
        self.tei_error(self.post("/embed", {"inputs": ["a"] * 5}), 413, "Validation",
                       "batch size 5 > maximum allowed batch size 4")
        self.tei_error(self.post("/embed", {"inputs": 5}), 422, "Validation")
        self.tei_error(self.post("/embed", None, data=b"{not json"), 422, "Validation")
        self.tei_error(self.post("/embed", {"inputs": "x" * 70000}), 413, "Validation", "length limit")
        self.tei_error(self.post("/embed", {"inputs": "word " * 400}), 413, "Validation", "256")  # too long, as TEI
        self.tei_error(self.post("/predict", {"inputs": "x"}), 424, "Backend", "not a classifier")
        self.tei_error(self.post("/embed_sparse", {"inputs": "x"}), 424, "Backend", "not a SPLADE model")
        self.tei_error(self.post("/embed_sparse", {"inputs": []}), 400, "Empty", "`inputs` cannot be empty")
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            refused = self.post("/embed", {"inputs": "x"}, headers=headers)
            assert refused.status_code == 401 and refused.text == "", (refused.status_code, refused.text)
        print("http_clients_test: TEI errors 400 Empty, 413, 422, 424, 401")

    def overload(self):
        """429 past --max_concurrent_requests=1, with the first request held on its workers."""
        hold = os.path.join(self.fault_dir, "worker_forward.hold")
        open(hold, "w").close()
        first = {}
        thread = threading.Thread(target=lambda: first.update(answer=self.post("/embed", {"inputs": "held"})))
        thread.start()
        try:
            deadline = time.monotonic() + 60
            while not glob.glob(os.path.join(self.fault_dir, "worker_forward.*.reached")):
                assert time.monotonic() < deadline, "the held request never reached a worker's forward"
                time.sleep(0.05)
            self.tei_error(self.post("/embed", {"inputs": "second"}), 429, "Overloaded", "Model is overloaded")
            try:
                self.client.embeddings.create(model="minilm", input="second")
                raise AssertionError("an overloaded server served")
            except openai.RateLimitError as e:
                assert e.status_code == 429, e
        finally:
            os.remove(hold)
            thread.join(timeout=60)
        assert first["answer"].status_code == 200, first["answer"].text
        for marker in glob.glob(os.path.join(self.fault_dir, "worker_forward.*.reached")):
            os.remove(marker)
        assert self.post("/embed", {"inputs": "after"}).status_code == 200  # the job keeps serving
        print("http_clients_test: 429 Overloaded (TEI) and RateLimitError (openai) under overload")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--http", required=True)
    parser.add_argument("--shardctl", required=True)
    parser.add_argument("--read_token_file", required=True)
    parser.add_argument("--fault_dir", required=True)
    checks = Checks(parser.parse_args())
    checks.openai_embeddings()
    checks.openai_errors()
    checks.tei_routes()
    checks.tei_errors()
    checks.overload()


if __name__ == "__main__":
    main()
