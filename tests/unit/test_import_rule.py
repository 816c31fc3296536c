"""The import rule is the architecture: services/common <- services/dock <- each of rollout, reward,
trainer and sandbox. Services never import each other; they meet only through proto/ contracts and the dock.
`launch` (dockrl up) starts them as processes and imports none of them."""
import ast
import pathlib

import pytest

SERVICES = pathlib.Path(__file__).resolve().parents[2] / "services"
ALLOWED = {
    "common": {"common"},
    "dock": {"common", "dock"},
    "rollout": {"common", "dock", "rollout"},
    "reward": {"common", "dock", "reward"},
    "trainer": {"common", "dock", "trainer"},
    "sandbox": {"common", "dock", "sandbox"},
    "launch": {"common", "dock", "launch", "cli"},
}


def imported_packages(path: pathlib.Path) -> set[tuple[str, int]]:
    """(services sub-package, line) of every import of services.* in `path`, inside functions too."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + ([f"{node.module}.{a.name}" for a in node.names] if node.module == "services" else [])
        for name in names:
            parts = name.split(".")
            if parts[0] == "services" and len(parts) > 1:
                found.add((parts[1], node.lineno))
    return found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_each_package_imports_only_what_the_rule_allows(package):
    broken = [f"{path.relative_to(SERVICES.parent)}:{line} imports services.{target}"
              for path in sorted((SERVICES / package).rglob("*.py"))
              for target, line in sorted(imported_packages(path)) if target not in ALLOWED[package]]
    assert not broken, "\n".join(broken)


def test_the_rule_sees_every_package_and_catches_a_breach(tmp_path):
    assert {p.name for p in SERVICES.iterdir() if p.is_dir() and (p / "__init__.py").exists()} == set(ALLOWED)
    breach = tmp_path / "x.py"
    breach.write_text("def f():\n    from services.rollout.engine import RolloutEngine\n")
    assert imported_packages(breach) == {("rollout", 2)}
