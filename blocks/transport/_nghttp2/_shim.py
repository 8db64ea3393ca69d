"""The C shim: libnghttp2's receive callbacks written in C, recording into one buffer that Python reads
once per call into the library, where ABI mode pays a call from C into Python per header field.

Built with cffi's API mode (a C compiler and Python's headers; no nghttp2 headers: the declarations
are :data:`~blocks.transport._nghttp2._ffi.CDEF`'s) the first time it is needed, into a cache
directory, and loaded from there afterwards; where it cannot be built, :func:`load` says why in one
line and the codec runs in ABI mode. ``python -m blocks.transport._nghttp2._shim`` builds it ahead
(an install step, or a container image's).

The record (:data:`LOG_FORMATS`), native byte order, one after another:

- ``H`` a header field: name length, value length (u32 each), the name, the value;
- ``D`` a DATA chunk: stream id (i32), length (u32), the bytes;
- ``F`` a frame received: type, flags (u8 each), stream id (i32), length (u32), then per type: DATA
  its padding, RST_STREAM its error code, WINDOW_UPDATE its increment (u32 ``a``); GOAWAY its last
  stream id and error code (``a``, ``b``) then its debug data's length (u32) and bytes; SETTINGS the
  number of entries (``a``) then each entry's id and value (u32 each);
- ``I`` a frame the library found invalid: stream id, the library's error code (i32 each);
- ``C`` a stream closed: stream id (i32), error code (u32);
- ``E`` the library's error message: its length (u32) and bytes.

It also submits a header list given as one buffer of names and values, their lengths and their
flags (``pb_submit_headers``), where ABI mode builds an ``nghttp2_nv`` array in Python.

A header block past ``cap`` (RFC 9113 6.5.2's count) fails the call (``overflow`` set): an HPACK
bomb stops in C, after at most one field past the cap.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

from blocks.transport._nghttp2._ffi import CDEF

SHIM_CDEF = """
typedef struct {
  char *buf;
  size_t len;
  size_t cap;
  size_t block;
  size_t limit;
  int overflow;
  int nomem;
} pb_log;

pb_log *pb_log_new(size_t limit);
void pb_log_del(pb_log *log);
void pb_set_callbacks(nghttp2_session_callbacks *cbs);
int32_t pb_submit_headers(nghttp2_session *session, uint8_t flags, int32_t stream_id, const char *data,
                          const char *lens, const char *nvflags, size_t n);
int pb_set_max_continuations(nghttp2_option *option, size_t value);
"""

SHIM_SOURCE = r"""
#include <stdlib.h>
#include <string.h>

static int pb_grow(pb_log *log, size_t more) {
  if (log->len + more <= log->cap) return 0;
  size_t cap = log->cap ? log->cap : 256;
  while (cap < log->len + more) cap *= 2;
  char *buf = realloc(log->buf, cap);
  if (buf == NULL) { log->nomem = 1; return -1; }
  log->buf = buf;
  log->cap = cap;
  return 0;
}

static void pb_put(pb_log *log, const void *data, size_t len) {
  memcpy(log->buf + log->len, data, len);
  log->len += len;
}

static void pb_u32(pb_log *log, uint32_t value) { pb_put(log, &value, 4); }
static void pb_i32(pb_log *log, int32_t value) { pb_put(log, &value, 4); }
static void pb_u8(pb_log *log, uint8_t value) { pb_put(log, &value, 1); }

pb_log *pb_log_new(size_t limit) {
  pb_log *log = calloc(1, sizeof(pb_log));
  if (log != NULL) log->limit = limit;
  return log;
}

void pb_log_del(pb_log *log) {
  if (log != NULL) free(log->buf);
  free(log);
}

static int pb_on_header(nghttp2_session *session, const nghttp2_frame *frame, const char *name,
                        size_t namelen, const char *value, size_t valuelen, uint8_t flags, void *user_data) {
  pb_log *log = user_data;
  log->block += namelen + valuelen + 32;
  if (log->block > log->limit) { log->overflow = 1; return -902; }
  if (pb_grow(log, 9 + namelen + valuelen)) return -902;
  pb_u8(log, 'H');
  pb_u32(log, (uint32_t)namelen);
  pb_u32(log, (uint32_t)valuelen);
  pb_put(log, name, namelen);
  pb_put(log, value, valuelen);
  return 0;
}

static int pb_on_data_chunk(nghttp2_session *session, uint8_t flags, int32_t stream_id, const char *data,
                            size_t len, void *user_data) {
  pb_log *log = user_data;
  if (pb_grow(log, 9 + len)) return -902;
  pb_u8(log, 'D');
  pb_i32(log, stream_id);
  pb_u32(log, (uint32_t)len);
  pb_put(log, data, len);
  return 0;
}

static int pb_on_frame_recv(nghttp2_session *session, const nghttp2_frame *frame, void *user_data) {
  pb_log *log = user_data;
  const nghttp2_frame_hd *hd = &frame->hd;
  uint32_t a = 0, b = 0;
  size_t extra = 0;
  switch (hd->type) {
  case 0: a = (uint32_t)frame->data.padlen; break;
  case 1: log->block = 0; break;
  case 3: a = frame->rst_stream.error_code; break;
  case 8: a = (uint32_t)frame->window_update.window_size_increment; break;
  case 7:
    a = (uint32_t)frame->goaway.last_stream_id;
    b = frame->goaway.error_code;
    extra = 4 + frame->goaway.opaque_data_len;
    break;
  case 4: a = (uint32_t)frame->settings.niv; extra = 8 * frame->settings.niv; break;
  }
  if (pb_grow(log, 19 + extra)) return -902;
  pb_u8(log, 'F');
  pb_u8(log, hd->type);
  pb_u8(log, hd->flags);
  pb_i32(log, hd->stream_id);
  pb_u32(log, (uint32_t)hd->length);
  pb_u32(log, a);
  pb_u32(log, b);
  if (hd->type == 7) {
    pb_u32(log, (uint32_t)frame->goaway.opaque_data_len);
    if (frame->goaway.opaque_data_len) pb_put(log, frame->goaway.opaque_data, frame->goaway.opaque_data_len);
  } else if (hd->type == 4) {
    for (size_t i = 0; i < frame->settings.niv; i++) {
      pb_u32(log, (uint32_t)frame->settings.iv[i].settings_id);
      pb_u32(log, frame->settings.iv[i].value);
    }
  }
  return 0;
}

static int pb_on_invalid_frame(nghttp2_session *session, const nghttp2_frame *frame, int lib_error,
                               void *user_data) {
  pb_log *log = user_data;
  log->block = 0;
  if (pb_grow(log, 9)) return -902;
  pb_u8(log, 'I');
  pb_i32(log, frame->hd.stream_id);
  pb_i32(log, lib_error);
  return 0;
}

static int pb_on_stream_close(nghttp2_session *session, int32_t stream_id, uint32_t error_code,
                              void *user_data) {
  pb_log *log = user_data;
  if (pb_grow(log, 9)) return -902;
  pb_u8(log, 'C');
  pb_i32(log, stream_id);
  pb_u32(log, error_code);
  return 0;
}

static int pb_on_error(nghttp2_session *session, int lib_error, const char *msg, size_t len, void *user_data) {
  pb_log *log = user_data;
  if (pb_grow(log, 5 + len)) return -902;
  pb_u8(log, 'E');
  pb_u32(log, (uint32_t)len);
  pb_put(log, msg, len);
  return 0;
}

int32_t pb_submit_headers(nghttp2_session *session, uint8_t flags, int32_t stream_id, const char *data,
                          const char *lens, const char *nvflags, size_t n) {
  nghttp2_nv stack[32] = {{0}};
  nghttp2_nv *nva = n <= 32 ? stack : malloc(n * sizeof(nghttp2_nv));
  if (nva == NULL) return -901;
  size_t at = 0;
  for (size_t i = 0; i < n; i++) {
    uint32_t namelen, valuelen;
    memcpy(&namelen, lens + 8 * i, 4);
    memcpy(&valuelen, lens + 8 * i + 4, 4);
    nva[i].name = (char *)data + at;
    nva[i].namelen = namelen;
    at += namelen;
    nva[i].value = (char *)data + at;
    nva[i].valuelen = valuelen;
    at += valuelen;
    nva[i].flags = (uint8_t)nvflags[i];
  }
  int32_t rv = nghttp2_submit_headers(session, flags, stream_id, NULL, nva, n, NULL);
  if (nva != stack) free(nva);
  return rv;
}

/* Newer (or patched) builds only: a weak reference, NULL where the library does not have it. */
void nghttp2_option_set_max_continuations(nghttp2_option *option, size_t val) __attribute__((weak));

int pb_set_max_continuations(nghttp2_option *option, size_t value) {
  if (nghttp2_option_set_max_continuations == NULL) return -1;
  nghttp2_option_set_max_continuations(option, value);
  return 0;
}

void pb_set_callbacks(nghttp2_session_callbacks *cbs) {
  nghttp2_session_callbacks_set_on_header_callback(cbs, pb_on_header);
  nghttp2_session_callbacks_set_on_data_chunk_recv_callback(cbs, pb_on_data_chunk);
  nghttp2_session_callbacks_set_on_frame_recv_callback(cbs, pb_on_frame_recv);
  nghttp2_session_callbacks_set_on_invalid_frame_recv_callback(cbs, pb_on_invalid_frame);
  nghttp2_session_callbacks_set_on_stream_close_callback(cbs, pb_on_stream_close);
  nghttp2_session_callbacks_set_error_callback2(cbs, pb_on_error);
}
"""

MODULE = "_proxyblocks_nghttp2_shim"


def _cache_dir() -> Path:
    base = os.environ.get("PROXYBLOCKS_CACHE") or os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    tag = hashlib.sha256((CDEF + SHIM_CDEF + SHIM_SOURCE + sys.version).encode()).hexdigest()[:16]
    return Path(base) / "proxyblocks" / f"nghttp2-shim-{tag}"


def _ffibuilder() -> Any:
    import cffi

    builder = cffi.FFI()
    builder.cdef(CDEF + SHIM_CDEF)
    declarations = CDEF.replace("typedef struct nghttp2_session nghttp2_session;", "")
    source = (
        "#include <stdint.h>\n#include <stddef.h>\n#include <sys/types.h>\n"
        "typedef struct nghttp2_session nghttp2_session;\n" + declarations + SHIM_CDEF + SHIM_SOURCE
    )
    builder.set_source(MODULE, source, extra_link_args=["-l:libnghttp2.so.14"])
    return builder


def build(directory: Path | None = None) -> Path:
    """Compile the shim into the cache (or ``directory``): the path of the extension module.
    Raises what the compiler or cffi raise."""
    target = directory or _cache_dir()
    target.mkdir(parents=True, exist_ok=True)
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    final = target / f"{MODULE}{suffix}"
    with tempfile.TemporaryDirectory(dir=target) as scratch:
        built = Path(_ffibuilder().compile(tmpdir=scratch, verbose=False))
        os.replace(built, final)  # (atomic: processes building at once all end with a whole module)
    return final


def load() -> tuple[Any, Any] | str:
    """``(ffi, lib)`` of the shim, built first if needed, or a one-line reason it cannot be used.

    ``PROXYBLOCKS_NGHTTP2_SHIM=0`` skips it (ABI mode).
    """
    if os.environ.get("PROXYBLOCKS_NGHTTP2_SHIM", "1") == "0":
        return "the shim is turned off (PROXYBLOCKS_NGHTTP2_SHIM=0)"
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    path = _cache_dir() / f"{MODULE}{suffix}"
    if not path.exists():
        try:
            path = build()
        except Exception as exc:  # (no compiler, no Python headers, no cffi builder: ABI mode)
            return (
                f"the C shim could not be built ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
            )
    spec = importlib.util.spec_from_file_location(MODULE, path)
    if spec is None or spec.loader is None:
        return f"the C shim at {path} cannot be loaded"
    try:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError as exc:
        return f"the C shim at {path} cannot be loaded ({exc})"
    return module.ffi, module.lib


if __name__ == "__main__":
    print(f"built {build()}")
