"""Save and restore a fit's state as a plain ``.npz`` file: no pickle, ever.

JAX (``stepfuse.jax.FitState``, or any JAX pytree of arrays)::

    from stepfuse import checkpoint
    checkpoint.save("fit.npz", state)                      # params, optax opt_state, step
    state = checkpoint.restore("fit.npz", fit.init(params))  # `like` gives the structure

The file is ``np.savez`` of the flattened pytree leaves, each stored under its tree
path (``jax.tree_util.keystr``, e.g. ``.opt_state[0].mu['kernel']``), plus two small
string arrays (the leaf order and dtypes) and a format version. Nothing in it is a
Python object: ``restore`` reads it with ``np.load(..., allow_pickle=False)`` and
rebuilds the pytree with the structure of ``like``, checking the leaf count, the
paths, the shapes and the dtypes, so a checkpoint can never run code and never
silently lands in the wrong slot. Values are stored bit for bit: a restored state
continues a fit exactly as if it had never stopped (also in a new process).

The module imports no framework at import time; the JAX functions import ``jax``
when called. (The TF and torch backends will add their own entry points here.)
"""

from __future__ import annotations

import os
import tempfile
import zipfile
from typing import Any

import numpy as np

__all__ = ["save", "restore", "FORMAT_VERSION"]

FORMAT_VERSION = 1
_VERSION_KEY = "__stepfuse_checkpoint__"
_PATHS_KEY = "__paths__"
_DTYPES_KEY = "__dtypes__"
_RESERVED = (_VERSION_KEY, _PATHS_KEY, _DTYPES_KEY)


def _flatten(tree: Any, name: str) -> tuple[list[str], list[Any], Any]:
    """``(paths, leaves, treedef)`` of a JAX pytree (``jax`` imported here, not at import)."""
    import jax

    with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    paths = [jax.tree_util.keystr(p) or "<root>" for p, _ in with_paths]
    leaves = [leaf for _, leaf in with_paths]
    if not leaves:
        raise ValueError(
            f"`{name}` must be a pytree with at least one array leaf (e.g. a "
            f"stepfuse.jax.FitState from fit.init(params)); got {type(tree).__name__} with none."
        )
    return paths, leaves, treedef


def _dtype_name(dtype: np.dtype) -> str:
    return np.dtype(dtype).name


def _key_impl(leaf: Any) -> str | None:
    """The PRNG implementation's name of a typed JAX key array (``jax.random.key``), or None."""
    dtype = getattr(leaf, "dtype", None)
    if dtype is None or isinstance(dtype, np.dtype):
        return None
    import jax

    if not jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return None
    return str(jax.random.key_impl(leaf)) if isinstance(leaf, jax.Array) else ""


def save(path: str | os.PathLike[str], state: Any) -> str:
    """Write ``state`` (a ``stepfuse.jax.FitState`` or any JAX pytree of arrays) to ``path``.

    The file is written next to its destination and moved into place, so an
    interrupted save never leaves a half-written checkpoint at ``path``. ``path`` is
    used as given (no ``.npz`` is appended). Returns ``path`` as a string.

    Raises:
      TypeError: a leaf of ``state`` is not a numeric array (e.g. a torch or Keras
        object); the message names the leaf's path.
    """
    path = os.fspath(path)
    paths, leaves, _ = _flatten(state, "state")
    if len(set(paths)) != len(paths):
        dup = sorted({p for p in paths if paths.count(p) > 1})
        raise ValueError(
            f"`state` has leaves with the same tree path {dup}; cannot key them uniquely."
        )
    arrays, dtypes = {}, []
    for key, leaf in zip(paths, leaves):
        if key in _RESERVED:
            raise ValueError(f"`state` has a leaf at the reserved path {key!r}.")
        impl = _key_impl(leaf)
        if impl is not None:  # typed PRNG keys (optax.noisy_sgd's state): their raw bits
            import jax

            arrays[key] = np.asarray(jax.random.key_data(leaf))
            dtypes.append(f"{leaf.dtype}|{impl}")
            continue
        what = f"{type(leaf).__module__}.{type(leaf).__name__}"
        try:
            arr = np.asarray(leaf)
        except Exception as e:  # noqa: BLE001 - anything NumPy cannot take: named below
            arr, what = np.asarray(None), f"{what}, which NumPy cannot read ({e})"
        if arr.dtype == object or arr.dtype.kind not in "biufcV":
            raise TypeError(
                f"`state` must hold only numeric arrays; the leaf at state{key} is "
                f"{what} (as an array: dtype {arr.dtype}). "
                "checkpoint.save stores a stepfuse.jax.FitState (or a JAX pytree of arrays); "
                "it never pickles Python objects."
            )
        arrays[key] = arr
        dtypes.append(_dtype_name(arr.dtype))
    arrays[_VERSION_KEY] = np.asarray(FORMAT_VERSION, np.int64)
    arrays[_PATHS_KEY] = np.asarray(paths, dtype=np.str_)
    arrays[_DTYPES_KEY] = np.asarray(dtypes, dtype=np.str_)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".stepfuse-ckpt-", suffix=".npz", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)  # type: ignore[arg-type]  # (numpy types **kwds as allow_pickle)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def _read(path: str) -> dict:
    """Every array of the checkpoint at ``path``, read with ``allow_pickle=False``."""
    try:
        npz = np.load(path, allow_pickle=False)
    except ValueError as e:  # a bare .npy of objects, or a pickle file
        raise ValueError(
            f"`path` {path!r} is not a stepfuse checkpoint: it contains pickled data, which "
            f"is never loaded ({e}). Write checkpoints with stepfuse.checkpoint.save."
        ) from None
    if not isinstance(npz, np.lib.npyio.NpzFile):
        raise ValueError(
            f"`path` {path!r} is not a stepfuse checkpoint (a bare .npy array, not an .npz "
            "archive). Write checkpoints with stepfuse.checkpoint.save."
        )
    out = {}
    with npz:
        for key in npz.files:
            try:
                out[key] = npz[key]
            except ValueError as e:  # "Object arrays cannot be loaded when allow_pickle=False"
                raise ValueError(
                    f"`path` {path!r} holds an object (pickled) array under {key!r}; "
                    f"stepfuse checkpoints never contain pickles and such a file is refused ({e})."
                ) from None
    return out


def restore(path: str | os.PathLike[str], like: Any) -> Any:
    """Read the checkpoint at ``path`` into a pytree with the structure of ``like``.

    Args:
      path: a file written by `save`.
      like: a pytree with the structure, shapes and dtypes expected, e.g.
        ``fit.init(params)`` (or ``jax.eval_shape(fit.init, params)``); its values
        are not used.

    Returns:
      The restored pytree (JAX arrays), e.g. a ``stepfuse.jax.FitState`` ready for
      ``fit(state, *batch)``.

    Raises:
      ValueError: ``path`` is not a stepfuse checkpoint or holds pickled data; or the
        checkpoint does not match ``like`` (leaf count, tree paths, shapes, dtypes),
        with the offending path named.
    """
    import jax
    import jax.numpy as jnp

    path = os.fspath(path)
    try:
        data = _read(path)
    except zipfile.BadZipFile as e:
        raise ValueError(
            f"`path` {path!r} is not a stepfuse checkpoint (a damaged .npz: {e})."
        ) from None
    if _VERSION_KEY not in data or _PATHS_KEY not in data:
        raise ValueError(
            f"`path` {path!r} is not a stepfuse checkpoint (no {_VERSION_KEY!r} entry). "
            "Write checkpoints with stepfuse.checkpoint.save."
        )
    version = int(data[_VERSION_KEY])
    if version != FORMAT_VERSION:
        raise ValueError(
            f"`path` {path!r} has checkpoint format {version}; this stepfuse reads format "
            f"{FORMAT_VERSION}."
        )
    saved_paths = [str(p) for p in data[_PATHS_KEY].tolist()]
    saved_dtypes = [str(d) for d in data[_DTYPES_KEY].tolist()] if _DTYPES_KEY in data else None
    paths, leaves, treedef = _flatten(like, "like")
    if len(saved_paths) != len(paths):
        missing = [p for p in paths if p not in saved_paths][:5]
        extra = [p for p in saved_paths if p not in paths][:5]
        raise ValueError(
            f"`like` has {len(paths)} leaves but the checkpoint `path` {path!r} holds "
            f"{len(saved_paths)}; only in `like`: {missing}, only in the checkpoint: {extra}. "
            "Pass the state of the same model and optimizer, e.g. fit.init(params)."
        )
    restored = []
    for i, (key, leaf) in enumerate(zip(paths, leaves)):
        if saved_paths[i] != key:
            raise ValueError(
                f"`like` leaf {i} is at {key} but the checkpoint `path` {path!r} has "
                f"{saved_paths[i]} there: a different model or optimizer state structure."
            )
        if key not in data:
            raise ValueError(
                f"`path` {path!r} lists {key} but holds no array for it (damaged file)."
            )
        arr = data[key]
        if getattr(leaf, "dtype", None) is not None and _key_impl(leaf) is not None:
            restored.append(
                _restore_keys(arr, leaf, saved_dtypes[i] if saved_dtypes else None, key, path)
            )
            continue
        want_shape = tuple(np.shape(leaf))
        want_dtype = np.dtype(getattr(leaf, "dtype", None) or np.asarray(leaf).dtype)
        if (
            arr.dtype.kind == "V"
            and saved_dtypes is not None
            and saved_dtypes[i] == want_dtype.name
        ):
            arr = arr.view(want_dtype)  # e.g. bfloat16, which .npy stores as raw bytes
        if tuple(arr.shape) != want_shape:
            raise ValueError(
                f"`like` has shape {want_shape} at {key} but the checkpoint `path` {path!r} "
                f"has {tuple(arr.shape)}."
            )
        if arr.dtype != want_dtype:
            raise ValueError(
                f"`like` has dtype {want_dtype} at {key} but the checkpoint `path` {path!r} "
                f"has {arr.dtype}."
            )
        restored.append(jnp.asarray(arr))
    return jax.tree_util.tree_unflatten(treedef, restored)


def _restore_keys(arr: np.ndarray, leaf: Any, saved: str | None, key: str, path: str) -> Any:
    """Typed PRNG keys from their saved bits (see `save`), checked against ``leaf``."""
    import jax

    kind, _, impl = (saved or "").partition("|")
    if kind != str(leaf.dtype) or not impl:
        raise ValueError(
            f"`like` has PRNG keys of dtype {leaf.dtype} at {key} but the checkpoint "
            f"`path` {path!r} has {kind or 'no keys'} there."
        )
    keys = jax.random.wrap_key_data(jax.numpy.asarray(arr), impl=impl)
    if keys.shape != tuple(leaf.shape):
        raise ValueError(
            f"`like` has shape {tuple(leaf.shape)} at {key} but the checkpoint "
            f"`path` {path!r} has keys of shape {keys.shape}."
        )
    return keys
