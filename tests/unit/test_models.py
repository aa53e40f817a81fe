"""What a backend's ``/v1/models`` answer teaches (txlb._cluster.models.learn), on its own."""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from txlb._cluster.models import MAX_MODEL_NAME, MAX_MODEL_NAMES, aliases_of, learn


class LearnTests(SynchronousTestCase):
    def test_ids_then_aliases_each_once(self) -> None:
        learned = learn([{"id": "a", "aliases": ["x", "a"]}, {"id": "b", "aliases": ["x"]},
                         {"object": "no id"}])
        self.assertEqual(learned.names, ("a", "b", "x"))
        self.assertEqual(set(learned.entries), {"a", "b"})
        self.assertEqual(learned.dropped, 0)
        # nothing was dropped, so every entry is kept as the engine listed it: an alias
        # repeating an id, or another entry's alias, is a name already known, not a drop
        self.assertEqual(learned.entries, {"a": {"id": "a", "aliases": ["x", "a"]},
                                           "b": {"id": "b", "aliases": ["x"]}})

    def test_names_of_512_characters_are_learned_and_longer_ones_not(self) -> None:
        """The documented bound, as a number: 512 characters is the longest name kept."""
        learned = learn([{"id": "a" * 512, "aliases": ["b" * 513]}, {"id": "c" * 513}])
        self.assertEqual(learned.names, ("a" * 512,))
        self.assertEqual(learned.dropped, 2)

    def test_too_long_and_too_many_names_are_dropped_and_counted(self) -> None:
        entries: list[dict[str, object]] = [{"id": "x" * (MAX_MODEL_NAME + 1)}]
        entries += [{"id": f"m{n}"} for n in range(MAX_MODEL_NAMES + 2)]
        learned = learn(entries)
        self.assertEqual(len(learned.names), MAX_MODEL_NAMES)
        self.assertEqual(learned.dropped, 3)
        self.assertNotIn("x" * (MAX_MODEL_NAME + 1), learned.entries)

    def test_an_entry_lists_only_the_aliases_kept(self) -> None:
        learned = learn([{"id": "m", "aliases": ["ok", "y" * (MAX_MODEL_NAME + 1)]}])
        self.assertEqual(learned.entries["m"]["aliases"], ["ok"])
        self.assertEqual(learned.dropped, 1)

    def test_aliases_are_non_empty_strings_only(self) -> None:
        self.assertEqual(aliases_of({"aliases": ["a", "", 3, None, "b"]}), ["a", "b"])
        self.assertEqual(aliases_of({"aliases": "a"}), [])
        self.assertEqual(aliases_of({}), [])
