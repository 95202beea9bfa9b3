"""Device groups of `replica_groups`: explicit `{{0,1},{2,3}}`, iota `[2,4]<=[8]` and mesh forms."""

from __future__ import annotations

import math
import re

import numpy as np

Groups = tuple[tuple[int, ...], ...]

_IOTA_GROUPS = re.compile(r"^\[([\d,\s]+)\]<=\[([\d,\s]+)\](?:T\(([\d,\s]+)\))?$")
# device_ids lists the mesh's devices, or gives them as an iota `[2,4]T(1,0)` (iota(8) reshaped, transposed).
_MESH_GROUPS = re.compile(
    r"^mesh\[([^\]]*)\](?:,\s*device_ids=\((\[[\d,]+\](?:T\([\d,]+\))?|[\d,\s]*)\))?\s*\{([^}]*)\}$"
)
_IOTA_DEVICES = re.compile(r"^\[([\d,]+)\](?:T\(([\d,]+)\))?$")
_MESH_AXIS = re.compile(r"'([^']*)'\s*=\s*(\d+)")
_AXIS_REF = re.compile(r"'([^']*)'(?::\((\d+)\)(\d+))?")


def explicit_groups(text: str) -> Groups:
    """`{{0,1},{2,3}}` as ((0, 1), (2, 3)); `{}` as ()."""
    inner = text.strip()[1:-1]
    return tuple(tuple(_ints(g)) for g in re.findall(r"\{([^{}]*)\}", inner))


def _ints(text: str) -> list[int]:
    """Comma-separated integers as a list; blank text gives none."""
    return [int(d) for d in text.split(",") if d.strip()]


def _split_axes(sizes: list[int], refs: list[tuple[int, int, int]]) -> tuple[list[int], list[int]]:
    """Every mesh axis split into the sub-axes the groups use (`(axis, pre-size, size)`) and the pieces
    between them: the dims of the split mesh, and the positions of the grouped pieces among them."""
    dims: list[int] = []
    grouped: list[int] = []
    for axis, full in enumerate(sizes):
        own = [(pre, size) for a, pre, size in refs if a == axis]
        position: dict[int, int] = {}
        prefix = 1
        for pre, size in sorted(own):
            if pre != prefix:
                dims.append(pre // prefix)
            position[pre] = len(dims)
            dims.append(size)
            prefix = pre * size
        if prefix != full:
            dims.append(full // prefix)
        grouped += [position[pre] for pre, _ in own]
    return dims, grouped


def _mesh_groups(text: str) -> Groups | None:
    """Groups of `mesh['a'=2,'b'=4] {'b'}` (sub-axes `'a':(pre)size`), as XLA's MeshAxesReplicaGroupList."""
    mesh = _MESH_GROUPS.match(text)
    if mesh is None:
        return None
    axes = [(name, int(size)) for name, size in _MESH_AXIS.findall(mesh.group(1))]
    index = {name: i for i, (name, _) in enumerate(axes)}
    sizes = [size for _, size in axes]
    devices = np.arange(math.prod(sizes))
    if iota := _IOTA_DEVICES.match(mesh.group(2) or ""):
        devices = devices.reshape(_ints(iota.group(1))).transpose(_ints(iota.group(2) or "") or None).ravel()
    elif mesh.group(2):
        devices = np.array(_ints(mesh.group(2)))
    refs = [
        (index[name], int(pre or 1), int(size or sizes[index[name]]))
        for name, pre, size in _AXIS_REF.findall(mesh.group(3))
    ]
    # With the grouped pieces moved last, each row of what remains, flattened, is one group.
    dims, grouped = _split_axes(sizes, refs)
    rest = [d for d in range(len(dims)) if d not in grouped]
    group_size = math.prod(dims[d] for d in grouped)
    ids = devices.reshape(dims).transpose(rest + grouped).reshape(-1, group_size)
    return tuple(tuple(int(d) for d in row) for row in ids)


def expand_replica_groups(text: str, num_devices: int) -> Groups:
    """Explicit device groups of replica_groups `{{0,1},{2,3}}`, `{}` (all devices), iota or mesh form."""
    text = text.strip()
    if text.startswith("{"):
        return explicit_groups(text) or (tuple(range(num_devices)),)
    mesh = _mesh_groups(text)
    if mesh is not None:
        return mesh
    iota = _IOTA_GROUPS.match(text)
    if iota is None:
        raise ValueError(f"unrecognised replica_groups {text!r}")
    group_dims, reshape_dims = _ints(iota.group(1)), _ints(iota.group(2))
    if math.prod(group_dims) != math.prod(reshape_dims):
        raise ValueError(f"replica_groups {text!r}: group dims and device dims hold different counts")
    ids = np.arange(math.prod(reshape_dims)).reshape(reshape_dims)
    if iota.group(3):
        ids = ids.transpose(_ints(iota.group(3)))
    # With more than two group dims the last is the group size and the others together count the groups.
    return tuple(tuple(int(d) for d in row) for row in ids.reshape(-1, group_dims[-1]))
