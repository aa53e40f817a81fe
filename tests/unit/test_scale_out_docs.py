"""
docs/scale-out.md's recipes are usable as written: every YAML block parses and its
Kubernetes objects fit together (selectors match the pods' labels, Services reach the
containers' ports, txlb's arguments name the Services that exist), the systemd unit parses
and runs txlb with shared state, and the simulator figures the page quotes are those of
bench/results/scale-out.md.
"""

from __future__ import annotations

import configparser
import re
from pathlib import Path
from typing import Any

import yaml
from twisted.trial.unittest import SynchronousTestCase

ROOT = Path(__file__).resolve().parent.parent.parent
PAGE = ROOT / "docs" / "scale-out.md"
RESULTS = ROOT / "bench" / "results" / "scale-out.md"
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def blocks(kind: str, text: str | None = None) -> list[str]:
    """The page's fenced code blocks of one language."""
    page = PAGE.read_text() if text is None else text
    return [body for lang, body in BLOCK.findall(page) if lang == kind]


def manifests() -> list[dict[str, Any]]:
    return [doc for block in blocks("yaml") for doc in yaml.safe_load_all(block)
            if doc is not None]


def containers(deployment: dict[str, Any]) -> list[dict[str, Any]]:
    return deployment["spec"]["template"]["spec"]["containers"]  # type: ignore[no-any-return]


def mounted(deployment: dict[str, Any], path: str) -> str | None:
    """The Secret whose volume holds ``path`` in the deployment's first container."""
    pod = deployment["spec"]["template"]["spec"]
    volumes = {v["name"]: v.get("secret", {}).get("secretName") for v in pod.get("volumes", [])}
    for mount in containers(deployment)[0].get("volumeMounts", []):
        if path.startswith(mount["mountPath"].rstrip("/") + "/"):
            return volumes.get(mount["name"])
    return None


class KubernetesRecipeTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.objects = manifests()
        self.by_kind: dict[str, dict[str, dict[str, Any]]] = {}
        for obj in self.objects:
            self.assertIn("apiVersion", obj)
            self.by_kind.setdefault(obj["kind"], {})[obj["metadata"]["name"]] = obj

    def test_every_yaml_block_parses_into_named_objects(self) -> None:
        self.assertGreaterEqual(len(blocks("yaml")), 1)
        self.assertEqual(set(self.by_kind), {"Service", "Deployment", "NetworkPolicy"})
        self.assertEqual(set(self.by_kind["Deployment"]), {"txlb", "txlb-redis"})
        self.assertEqual(set(self.by_kind["Service"]), {"txlb", "txlb-redis", "vllm"})

    def test_each_deployment_selects_its_own_pods(self) -> None:
        for name, deployment in self.by_kind["Deployment"].items():
            spec = deployment["spec"]
            labels = spec["template"]["metadata"]["labels"]
            self.assertEqual(spec["selector"]["matchLabels"], labels, name)

    def test_each_service_reaches_a_port_its_pods_listen_on(self) -> None:
        for name, service in self.by_kind["Service"].items():
            selector = service["spec"]["selector"]
            if name == "vllm":  # the engines' pods are the user's own
                self.assertEqual(service["spec"]["clusterIP"], "None", "headless")
                continue
            pods = [d for d in self.by_kind["Deployment"].values()
                    if d["spec"]["template"]["metadata"]["labels"] == selector]
            self.assertEqual(len(pods), 1, name)
            listening = {p["containerPort"] for c in containers(pods[0]) for p in c["ports"]}
            for port in service["spec"]["ports"]:
                self.assertIn(port["targetPort"], listening, name)

    def test_txlb_uses_the_services_the_page_defines(self) -> None:
        txlb = containers(self.by_kind["Deployment"]["txlb"])[0]
        args = dict(arg.split("=", 1) for arg in txlb["args"])
        self.assertEqual(txlb["command"][-1], "llmlb")
        backends = args["--backends"]
        self.assertTrue(backends.startswith("dns:vllm."), backends)
        engine_port = self.by_kind["Service"]["vllm"]["spec"]["ports"][0]["port"]
        self.assertTrue(backends.endswith(f":{engine_port}"), backends)
        redis = self.by_kind["Service"]["txlb-redis"]["spec"]["ports"][0]["port"]
        # Redis's password from the Secret Redis itself is started with, as a file
        url, _, query = args["--shared-state"].partition("?password_file=")
        self.assertEqual(url, f"redis://txlb-redis:{redis}/0")
        self.assertEqual(mounted(self.by_kind["Deployment"]["txlb"], query), "txlb-redis")
        redis_pod = self.by_kind["Deployment"]["txlb-redis"]
        self.assertIn("--requirepass", containers(redis_pod)[0]["command"][-1])
        self.assertIn(query, containers(redis_pod)[0]["command"][-1])
        self.assertEqual(mounted(redis_pod, query), "txlb-redis")
        self.assertEqual(args["--listen"], f"tcp:{txlb['ports'][0]['containerPort']}")
        probe = txlb["readinessProbe"]["httpGet"]
        self.assertEqual((probe["path"], probe["port"]), ("/__lb_status", 8000))
        # no secret in the manifest itself: the admin token comes from a Secret
        env = {e["name"]: e for e in txlb["env"]}
        self.assertIn("secretKeyRef", env["LB_ADMIN_TOKEN"]["valueFrom"])

    def test_only_txlb_reaches_redis(self) -> None:
        (policy,) = self.by_kind["NetworkPolicy"].values()
        redis_labels = self.by_kind["Deployment"]["txlb-redis"]["spec"]["template"][
            "metadata"]["labels"]
        txlb_labels = self.by_kind["Deployment"]["txlb"]["spec"]["template"]["metadata"][
            "labels"]
        self.assertEqual(policy["spec"]["podSelector"]["matchLabels"], redis_labels)
        (rule,) = policy["spec"]["ingress"]
        self.assertEqual([f["podSelector"]["matchLabels"] for f in rule["from"]],
                         [txlb_labels])
        redis = self.by_kind["Service"]["txlb-redis"]["spec"]["ports"][0]["targetPort"]
        self.assertEqual([p["port"] for p in rule["ports"]], [redis])

    def test_a_broken_block_would_be_caught(self) -> None:
        page = "```yaml\nkind: Service\n  metadata: [\n```\n"
        with self.assertRaises(yaml.YAMLError):
            list(yaml.safe_load_all(blocks("yaml", page)[0]))


class SystemdRecipeTests(SynchronousTestCase):
    def test_the_unit_parses_and_runs_txlb_with_shared_state(self) -> None:
        (unit,) = blocks("ini")
        parser = configparser.ConfigParser(interpolation=None, strict=True)
        parser.optionxform = str  # type: ignore[assignment,method-assign]
        parser.read_string(unit)
        service = parser["Service"]
        command = service["ExecStart"].split()
        self.assertTrue(command[0].endswith("/twistd"))
        self.assertIn("llmlb", command)
        self.assertTrue(any(arg.startswith("redis://") for arg in command))
        self.assertIn("--shared-state", command)
        self.assertEqual(service["KillMode"], "mixed")  # --workers: SIGTERM to the supervisor
        self.assertEqual(parser["Install"]["WantedBy"], "multi-user.target")


class FiguresTests(SynchronousTestCase):
    def test_the_quoted_simulator_figures_are_in_the_results(self) -> None:
        page = PAGE.read_text()
        results = set(re.findall(r"\b\d+\.\d{2,3}\b", RESULTS.read_text()))
        for heading in ("### How close shared counts", "## The cache-aware index"):
            begin = page.index(heading)
            end = page.find("\n## ", begin + 1)
            rows = [line for line in page[begin:end if end > 0 else None].splitlines()
                    if line.startswith("|")]
            figures = {f for row in rows for f in re.findall(r"\b\d+\.\d{2,3}\b", row)}
            self.assertGreater(len(figures), 20, heading)
            missing = sorted(figures - results)
            self.assertEqual(missing, [], f"figures under {heading!r} not in the results")


class SessionPinsTests(SynchronousTestCase):
    """The page's claim: session affinity needs no shared state between replicas."""

    def test_replicas_with_the_same_backends_pin_a_session_alike(self) -> None:
        from txlb import BackendSpec, Pool
        from txlb._scheduling.affinity import BoundedLoadRing

        specs = tuple(BackendSpec("10.0.0.1", 8000 + n) for n in range(8))
        one, other = Pool(specs), Pool(tuple(reversed(specs)))  # listed in another order
        ring_one, ring_other = BoundedLoadRing(), BoundedLoadRing()
        sessions = [f"user-{n}" for n in range(2000)]
        pins = [ring_one.choose(s, list(one)).key for s in sessions]
        self.assertEqual(pins, [ring_other.choose(s, list(other)).key for s in sessions])
        self.assertEqual(len(set(pins)), 8)  # and the sessions do spread over the fleet
        # a replica whose own counts put that engine over its bound passes the session on
        home = one.get(pins[0])
        assert home is not None
        home.counts.counted(50)
        self.assertNotEqual(ring_one.choose(sessions[0], list(one)).key, pins[0])
