"""Plain data: the only thing that crosses between the checker (the problem's tests) and the worker (the answer).

Plain data is None, bool, int, float, complex, str and bytes, and lists, tuples, dicts and sets of plain data (the
exact built-in types: a subclass, with its own ``__eq__``, is not plain), at most :data:`PLAIN_DEPTH` containers
deep and :data:`PLAIN_ITEMS` values, encoded in at most :data:`PLAIN_BYTES` bytes. Anything else fails to encode
(:class:`NotPlain`); a decoder builds fresh built-in objects from the bytes and refuses whatever is not exactly such
an encoding, so nothing the answer wrote can become code, a class or an object with methods of its own.

Frames on a pipe: 8 bytes of length (little-endian), then the encoding. Also compiled into the launcher's and the
worker's code (never imported there): it imports nothing but the interpreter's built-in modules.
"""
import os

PLAIN_DEPTH = 100
PLAIN_ITEMS = 1 << 20
PLAIN_BYTES = 64 << 20
_F64 = None


class NotPlain(TypeError):
    """A value that is not plain data, or bytes that are not its encoding."""


def _f64():
    global _F64
    if _F64 is None:
        import _struct

        _F64 = _struct.Struct("<d")
    return _F64


def plain_dumps(value) -> bytes:
    out, count = [], [0]
    f64 = _f64()

    def put(x, depth):
        count[0] += 1
        if count[0] > PLAIN_ITEMS:
            raise NotPlain(f"more than {PLAIN_ITEMS} values")
        t = type(x)
        if x is None:
            out.append(b"N")
        elif t is bool:
            out.append(b"T" if x else b"F")
        elif t is int:
            n = (x.bit_length() + 8) // 8
            if n > PLAIN_BYTES:
                raise NotPlain("an int too large")
            out.append(b"i" + n.to_bytes(8, "little") + x.to_bytes(n, "little", signed=True))
        elif t is float:
            out.append(b"f" + f64.pack(x))
        elif t is complex:
            out.append(b"c" + f64.pack(x.real) + f64.pack(x.imag))
        elif t is str:
            data = x.encode("utf-8", "surrogatepass")
            out.append(b"s" + len(data).to_bytes(8, "little") + data)
        elif t is bytes:
            out.append(b"b" + len(x).to_bytes(8, "little") + x)
        elif t in (list, tuple, set, dict):
            if depth >= PLAIN_DEPTH:
                raise NotPlain(f"containers nested deeper than {PLAIN_DEPTH}")
            tag = {list: b"l", tuple: b"t", set: b"S", dict: b"d"}[t]
            items = list(x.items()) if t is dict else list(x)  # a copy: a container that changes is not read twice
            out.append(tag + len(items).to_bytes(8, "little"))
            for item in items:
                if t is dict:
                    put(item[0], depth + 1)
                    put(item[1], depth + 1)
                else:
                    put(item, depth + 1)
        else:
            raise NotPlain(f"a {_type_name(x)}")

    put(value, 0)
    data = b"".join(out)
    if len(data) > PLAIN_BYTES:
        raise NotPlain(f"more than {PLAIN_BYTES} bytes")
    return data


def _type_name(x) -> str:
    try:
        name = type(x).__name__
        return name if isinstance(name, str) and name.isidentifier() else "object"
    except BaseException:  # noqa: BLE001 - a hostile type
        return "object"


def plain_loads(data: bytes):
    if type(data) is not bytes or len(data) > PLAIN_BYTES:
        raise NotPlain("not an encoding of plain data")
    f64 = _f64()
    at, count = [0], [0]

    def take(n):
        if n < 0 or at[0] + n > len(data):
            raise NotPlain("a truncated encoding")
        got = data[at[0]:at[0] + n]
        at[0] += n
        return got

    def size():
        return int.from_bytes(take(8), "little")

    def get(depth):
        count[0] += 1
        if count[0] > PLAIN_ITEMS:
            raise NotPlain(f"more than {PLAIN_ITEMS} values")
        tag = take(1)
        if tag == b"N":
            return None
        if tag == b"T":
            return True
        if tag == b"F":
            return False
        if tag == b"i":
            return int.from_bytes(take(size()), "little", signed=True)
        if tag == b"f":
            return f64.unpack(take(8))[0]
        if tag == b"c":
            return complex(f64.unpack(take(8))[0], f64.unpack(take(8))[0])
        if tag == b"s":
            return take(size()).decode("utf-8", "surrogatepass")
        if tag == b"b":
            return take(size())
        if tag in (b"l", b"t", b"S", b"d"):
            if depth >= PLAIN_DEPTH:
                raise NotPlain(f"containers nested deeper than {PLAIN_DEPTH}")
            n = size()
            if n > len(data):
                raise NotPlain("a truncated encoding")
            if tag == b"d":
                return {get(depth + 1): get(depth + 1) for _ in range(n)}
            items = [get(depth + 1) for _ in range(n)]
            return items if tag == b"l" else tuple(items) if tag == b"t" else set(items)
        raise NotPlain("not an encoding of plain data")

    try:
        value = get(0)
    except NotPlain:
        raise
    except (TypeError, ValueError, UnicodeDecodeError, OverflowError) as e:  # an unhashable key, a bad string
        raise NotPlain(f"not an encoding of plain data ({type(e).__name__})") from None
    if at[0] != len(data):
        raise NotPlain("bytes after the encoding")
    return value


def write_frame(fd, data: bytes) -> None:
    view = memoryview(len(data).to_bytes(8, "little") + data)
    while view:
        view = view[os.write(fd, view):]


def read_frame(fd):
    """The next frame's bytes; None at the end of the pipe (or a frame cut short, or one too long)."""
    head = _read(fd, 8)
    if head is None:
        return None
    n = int.from_bytes(head, "little")
    if n > PLAIN_BYTES:
        return None
    return _read(fd, n)


def _read(fd, n):
    parts, left = [], n
    while left:
        try:
            chunk = os.read(fd, min(left, 1 << 20))
        except InterruptedError:
            continue
        except OSError:
            return None
        if not chunk:
            return None
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)
