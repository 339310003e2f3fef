#!/usr/bin/python3
"""Static checks of deploy/docker: the CPU Dockerfile and the GPU Dockerfile.cuda (which cannot be
built here) parse, start from debian:bookworm-slim, build the same Bazel targets (the CUDA one with
--config=cuda and the pinned PyTorch wheel's CUDA LibTorch), install the same binaries, and end in a runtime stage with a
non-root user (10001), OCI labels, no compiler and no -dev package; compose.yaml starts the
coordinator and workers with the fixed flags. Standard library only (plus `docker-compose config`
where Debian's docker-compose is installed).
"""
import os
import re
import shlex
import shutil
import subprocess
import sys
import unittest

HERE = os.path.dirname(os.path.realpath(__file__))
REPO = os.path.dirname(HERE)
DOCKER = os.path.join(REPO, "deploy", "docker")
TARGETS = {"//server:bertshard-coordinator", "//worker:shard-worker", "//worker:shard-rank", "//client:shardctl"}
BINARIES = {"bertshard-coordinator", "shard-worker", "shard-rank", "shardctl"}
COMPILERS = re.compile(r"^(gcc|g\+\+|clang|cpp|build-essential|cuda-nvcc.*|cuda-toolkit.*|cuda-compiler.*|"
                       r"gcc-\d+|g\+\+-\d+|.*-dev|bazel.*|default-jdk.*|openjdk.*)$")


def read(path):
    with open(path) as f:
        return f.read()


def parse(path):
    """[(instruction, argument text)] with comments dropped and continuation lines joined."""
    out, pending = [], ""
    for raw in read(path).splitlines():
        line = raw.rstrip("\n")
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if pending and line.lstrip().startswith("#"):
            continue  # a comment inside a continued instruction
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        pending += line
        word, _, rest = pending.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        pending = ""
    assert not pending, f"{path}: ends inside a continued line"
    return out


class Stage:
    def __init__(self, base, name):
        self.base, self.name, self.instructions = base, name, []

    def args(self, word):
        return [a for w, a in self.instructions if w == word]


def stages(path):
    result = []
    for word, arg in parse(path):
        if word == "FROM":
            parts = arg.split()
            name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else None
            result.append(Stage(parts[0], name))
        elif word == "ARG" and not result:
            continue
        else:
            assert result, f"{path}: {word} before FROM"
            result[-1].instructions.append((word, arg))
    return result


def chain(all_stages, stage):
    """The stage and the stages it derives from (FROM <earlier stage>)."""
    names = {s.name: s for s in all_stages if s.name}
    out = [stage]
    while out[-1].base in names:
        out.append(names[out[-1].base])
    return out


def apt_packages(run_text):
    pkgs = []
    for m in re.finditer(r"apt-get install ([^;&|]*)", run_text):
        pkgs += [t for t in shlex.split(m.group(1)) if not t.startswith("-") and "=" not in t]
    return pkgs


def bazel_builds(stage):
    """(targets, flags) of every `bazel ... build` in the stage's RUN lines (targets through a
    shell variable assignment on the same RUN are resolved)."""
    targets, flags = set(), set()
    for run_text in stage.args("RUN"):
        if not re.search(r"\bbazel\b.*\bbuild\b", run_text):
            continue
        targets |= set(re.findall(r"//[A-Za-z0-9_/.-]*:[A-Za-z0-9_.-]+", run_text))
        flags |= set(re.findall(r"--config=\w+", run_text))
    return targets, flags


class DockerfileTest(unittest.TestCase):
    maxDiff = None

    def check_common(self, path, image_title):
        all_stages = stages(path)
        self.assertGreaterEqual(len(all_stages), 2, "multi-stage")
        for s in all_stages:
            if s.base not in {x.name for x in all_stages if x.name}:
                self.assertEqual(s.base, "debian:bookworm-slim", f"{path}: stages start from debian:bookworm-slim")
        build = [s for s in all_stages if s.name == "build"]
        self.assertEqual(len(build), 1, f"{path}: one stage named build")
        build = build[0]
        self.assertTrue(any(a.startswith("tools/install_deps.sh ") for a in build.args("COPY")) and
                        any("install_deps.sh" in a for a in build.args("RUN")),
                        f"{path}: the build stage installs packages as the README does (tools/install_deps.sh)")
        targets, flags = bazel_builds(build)
        runtime = all_stages[-1]
        self.assertNotEqual(runtime.name, "build")
        # USER: non-root, numeric 10001:10001, the last USER of the final stage.
        users = runtime.args("USER")
        self.assertTrue(users, f"{path}: the runtime stage sets USER")
        self.assertEqual(users[-1], "10001:10001")
        self.assertTrue(any("--uid 10001" in a and "--gid 10001" in a for a in runtime.args("RUN")),
                        f"{path}: a user with uid/gid 10001 exists")
        labels = " ".join(runtime.args("LABEL"))
        for key in ("org.opencontainers.image.title", "org.opencontainers.image.description",
                    "org.opencontainers.image.version", "org.opencontainers.image.revision"):
            self.assertIn(key, labels)
        self.assertIn(f'org.opencontainers.image.title="{image_title}"', labels)
        # No compiler, no -dev package, no Bazel in the runtime image (including a base stage it derives from).
        for s in chain(all_stages, runtime):
            for run_text in s.args("RUN"):
                for p in apt_packages(run_text):
                    self.assertIsNone(COMPILERS.match(p), f"{path}: {p} installed in the runtime image")
            self.assertFalse([a for a in s.args("RUN") if "install_deps.sh" in a],
                             f"{path}: the runtime image runs install_deps.sh")
        copies = runtime.args("COPY")
        from_build = [c for c in copies if c.startswith("--from=")]
        self.assertTrue(from_build, f"{path}: the runtime stage copies the build's outputs")
        self.assertFalse([c for c in copies if not c.startswith("--from=")],
                         f"{path}: the runtime stage copies nothing from the context (sources)")
        self.assertIn("/out/ /usr/local/bin/", " ".join(from_build))
        installed = set()
        for run_text in build.args("RUN"):
            m = re.search(r"install -m 0755 (.*?) /out/", run_text)
            if m:
                installed |= {os.path.basename(p) for p in m.group(1).split()}
        self.assertEqual(installed, BINARIES, f"{path}: the binaries put in /usr/local/bin")
        cmd = " ".join(runtime.args("CMD"))
        for flag in ("--listen=0.0.0.0:50051", "--metrics_listen=0.0.0.0:9090", "--data_dir=/var/lib/bertshard"):
            self.assertIn(flag, cmd)
        self.assertTrue(any("ldd" in a for a in runtime.args("RUN")), f"{path}: ldd checks the runtime libraries")
        return targets, flags

    def test_cpu_and_cuda_build_the_same_targets(self):
        cpu_targets, cpu_flags = self.check_common(os.path.join(DOCKER, "Dockerfile"), "bertshard")
        cuda_path = os.path.join(DOCKER, "Dockerfile.cuda")
        cuda_targets, cuda_flags = self.check_common(cuda_path, "bertshard-cuda")
        self.assertEqual(cpu_targets, TARGETS, "the CPU image builds exactly the four binaries (no tests)")
        self.assertEqual(cuda_targets, cpu_targets)
        self.assertEqual(cpu_flags, set())
        self.assertEqual(cuda_flags, {"--config=cuda"})

    def test_cuda_image_takes_libtorch_from_the_pinned_wheel(self):
        """Issue 22: Dockerfile.cuda downloaded LibTorch 2.4.1 / CUDA 12.4 from download.pytorch.org
        while everything GPU-side was built and checked against the PyTorch 2.11 / CUDA 13 wheel of
        tools/requirements-libtorch.txt. The image must take LibTorch (and the CUDA runtime and
        NCCL the wheel pins) from that wheel through tools/libtorch_from_wheel.sh, and install the
        rest of CUDA for the wheel's CUDA release."""
        cuda_path = os.path.join(DOCKER, "Dockerfile.cuda")
        text = read(cuda_path)
        all_stages = stages(cuda_path)
        self.assertFalse("download.pytorch.org" in text, "Dockerfile.cuda downloads LibTorch from download.pytorch.org")
        self.assertFalse("LIBTORCH_URL" in text, "Dockerfile.cuda takes LibTorch from LIBTORCH_URL")
        build = [s for s in all_stages if s.name == "build"][0]
        copies = " ".join(build.args("COPY"))
        for tool in ("tools/requirements-libtorch.txt", "tools/libtorch_from_wheel.sh"):
            self.assertIn(tool, copies, f"the build stage does not copy {tool} before building")
        runs = " ".join(build.args("RUN"))
        self.assertRegex(runs, r"bash tools/libtorch_from_wheel\.sh\)")
        self.assertIn("bash tools/libtorch_from_wheel.sh --cuda-home", runs)
        env = " ".join(build.args("ENV"))
        self.assertIn("BERTSHARD_LIBTORCH=/opt/libtorch-wheel/site-packages/torch", env)
        self.assertIn("CUDA_HOME=/opt/libtorch-wheel/cuda", env)
        # The CUDA release every stage installs is the wheel's (nvidia-cuda-runtime==13.0.x -> 13-0).
        requirements = read(os.path.join(REPO, "tools", "requirements-libtorch.txt"))
        runtime_version = re.search(r"^nvidia-cuda-runtime==(\d+)\.(\d+)\.", requirements, re.M)
        self.assertIsNotNone(runtime_version, "tools/requirements-libtorch.txt pins no nvidia-cuda-runtime")
        wanted = f"{runtime_version.group(1)}-{runtime_version.group(2)}"
        versions = re.findall(r"^ARG CUDA_VERSION=(\S+)$", text, re.M)
        self.assertTrue(versions, "no ARG CUDA_VERSION")
        self.assertEqual(set(versions), {wanted}, f"CUDA_VERSION {versions} is not the wheel's CUDA {wanted}")
        self.assertRegex(requirements, re.compile(r"^torch==2\.", re.M), "the pinned wheel is a PyTorch 2.x")
        # What the wheel's libtorch_cuda.so loads beyond its own CUDA runtime, CUPTI and NCCL (the
        # list tools/gpu_bundle.sh leaves to a GPU host's PyTorch) is installed in the CUDA base.
        cuda_base = [s for s in all_stages if s.name == "cuda-base"][0]
        packages = " ".join(cuda_base.args("RUN"))
        for lib in ("cublas", "cufft", "curand", "cusolver", "cusparse", "nvjitlink", "nvrtc", "nvtx", "cufile",
                    "cudnn", "cusparselt", "nvshmem"):
            self.assertRegex(packages, rf"\b(lib)?(cuda-)?{lib}\d*-", f"the CUDA base installs no {lib}")
        self.assertNotIn("cuda-cudart", packages, "the CUDA runtime comes from the wheel, not a second one")
        self.assertNotIn("libnccl2", packages, "NCCL comes from the wheel, not a second one")
        # The runtime stage holds the wheel's libraries at the paths the binaries' rpath names.
        self.assertIn("COPY --from=build /runtime/ /opt/libtorch-wheel/site-packages/", text)
        self.assertIn("/opt/libtorch-wheel/site-packages/nvidia/nccl/lib", text)

    def test_parser_sees_continuations_and_comments(self):
        s = stages(os.path.join(DOCKER, "Dockerfile"))
        self.assertEqual([(x.base, x.name) for x in s], [("debian:bookworm-slim", "build"), ("debian:bookworm-slim", None)])

    def test_dockerignore_keeps_bazel_outputs_and_git_out(self):
        lines = {l.strip() for l in read(os.path.join(REPO, ".dockerignore")).splitlines() if l.strip() and not l.startswith("#")}
        self.assertTrue({".git", "bazel-*"} <= lines)

    def test_compose(self):
        path = os.path.join(DOCKER, "compose.yaml")
        text = read(path)
        self.assertIn("image: ${BERTSHARD_IMAGE:-bertshard:dev}", text)
        for flag in ("--listen=0.0.0.0:50051", "--metrics_listen=0.0.0.0:9090", "--data_dir=/var/lib/bertshard",
                     "--listen=0.0.0.0:50061", "--metrics_listen=0.0.0.0:9091", "--coordinator=coordinator:50051",
                     "--advertise=$$(hostname):50061"):
            self.assertIn(flag, text)
        self.assertIn(":/models:ro", text)
        self.assertIn(":/var/lib/bertshard", text)
        compose = shutil.which("docker-compose")
        if compose is None:
            print("docker-compose not installed: compose.yaml checked as text only")
            return
        p = subprocess.run([compose, "-f", path, "config"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=dict(os.environ, BERTSHARD_MODELS="/models-on-host"))
        self.assertEqual(p.returncode, 0, p.stderr)
        services = re.findall(r"^  ([a-z0-9-]+):$", p.stdout.split("\nservices:\n", 1)[1].split("\nvolumes:", 1)[0], re.M)
        self.assertEqual(sorted(services), ["coordinator", "worker-1", "worker-2", "worker-3", "worker-4"])
        self.assertIn("/models-on-host:/models:ro", p.stdout)
        self.assertEqual(p.stdout.count("image: bertshard:dev"), 5)
        self.assertEqual(p.stdout.count("--coordinator=coordinator:50051"), 4)


if __name__ == "__main__":
    unittest.main(verbosity=2)
