"""Least-connections choice, on its own."""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from txlb import BackendSpec, LeastConnections, Pool


def pool_of(*weights: int) -> Pool:
    return Pool(tuple(BackendSpec("127.0.0.1", 9000 + n, weight=w) for n, w in enumerate(weights)))


class LeastConnectionsTests(SynchronousTestCase):
    def test_fewest_in_flight_wins(self) -> None:
        pool = pool_of(1, 1, 1)
        a, b, c = list(pool)
        for backend, active in ((a, 3), (b, 1), (c, 2)):
            backend.counted(active)
        self.assertIs(LeastConnections().choose([a, b, c]), b)

    def test_ties_rotate(self) -> None:
        backends = list(pool_of(1, 1, 1, 1))
        policy = LeastConnections()
        chosen = [policy.choose(backends).port for _ in range(8)]
        self.assertEqual(chosen, [9000, 9001, 9002, 9003] * 2)

    def test_rotation_skips_busier_backends(self) -> None:
        backends = list(pool_of(1, 1, 1))
        backends[1].counted(1)
        policy = LeastConnections()
        self.assertEqual([policy.choose(backends).port for _ in range(4)],
                         [9000, 9002, 9000, 9002])

    def test_weight_divides_in_flight(self) -> None:
        heavy, light = list(pool_of(4, 1))
        heavy.counted(3)
        light.counted(1)  # 0.75 < 1
        self.assertIs(LeastConnections().choose([heavy, light]), heavy)

    def test_ipv6_key_is_bracketed(self) -> None:
        spec = BackendSpec("::1", 8002)
        self.assertEqual(spec.key, "[::1]:8002")
