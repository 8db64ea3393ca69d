"""libnghttp2 through cffi's ABI mode: the declarations proxyblocks uses, and :func:`load`.

ABI mode needs no compiler and no headers: ``ffi.dlopen`` of the shared
library Debian ships as ``libnghttp2-14`` (``libnghttp2.so.14``; the soname
has been ABI-stable since 2015). The declarations below are copied from
``nghttp2.h`` (1.52), only what the codec calls; a struct is declared whole
where the codec reads one of its fields, so that its layout is the
library's. Where the header says ``uint8_t *`` for bytes (header fields, DATA,
the input), this says ``char *``, the same in the ABI, so that cffi takes and
gives ``bytes`` without a cast.
"""

from __future__ import annotations

import ctypes.util
import os
from typing import Any

CDEF = """
typedef struct nghttp2_session nghttp2_session;
typedef struct nghttp2_session_callbacks nghttp2_session_callbacks;
typedef struct nghttp2_option nghttp2_option;
typedef struct nghttp2_stream nghttp2_stream;

typedef struct {
  char *name;
  char *value;
  size_t namelen;
  size_t valuelen;
  uint8_t flags;
} nghttp2_nv;

typedef struct {
  size_t length;
  int32_t stream_id;
  uint8_t type;
  uint8_t flags;
  uint8_t reserved;
} nghttp2_frame_hd;

typedef union {
  int fd;
  void *ptr;
} nghttp2_data_source;

typedef ssize_t (*nghttp2_data_source_read_callback)(
    nghttp2_session *session, int32_t stream_id, uint8_t *buf, size_t length,
    uint32_t *data_flags, nghttp2_data_source *source, void *user_data);

typedef struct {
  nghttp2_data_source source;
  nghttp2_data_source_read_callback read_callback;
} nghttp2_data_provider;

typedef struct { nghttp2_frame_hd hd; size_t padlen; } nghttp2_data;
typedef struct { int32_t stream_id; int32_t weight; uint8_t exclusive; } nghttp2_priority_spec;
typedef struct {
  nghttp2_frame_hd hd;
  size_t padlen;
  nghttp2_priority_spec pri_spec;
  nghttp2_nv *nva;
  size_t nvlen;
  int cat;
} nghttp2_headers;
typedef struct { nghttp2_frame_hd hd; nghttp2_priority_spec pri_spec; } nghttp2_priority;
typedef struct { nghttp2_frame_hd hd; uint32_t error_code; } nghttp2_rst_stream;
typedef struct { int32_t settings_id; uint32_t value; } nghttp2_settings_entry;
typedef struct { nghttp2_frame_hd hd; size_t niv; nghttp2_settings_entry *iv; } nghttp2_settings;
typedef struct {
  nghttp2_frame_hd hd;
  size_t padlen;
  nghttp2_nv *nva;
  size_t nvlen;
  int32_t promised_stream_id;
  uint8_t reserved;
} nghttp2_push_promise;
typedef struct { nghttp2_frame_hd hd; uint8_t opaque_data[8]; } nghttp2_ping;
typedef struct {
  nghttp2_frame_hd hd;
  int32_t last_stream_id;
  uint32_t error_code;
  char *opaque_data;
  size_t opaque_data_len;
  uint8_t reserved;
} nghttp2_goaway;
typedef struct { nghttp2_frame_hd hd; int32_t window_size_increment; uint8_t reserved; } nghttp2_window_update;
typedef struct { nghttp2_frame_hd hd; void *payload; } nghttp2_extension;
typedef union {
  nghttp2_frame_hd hd;
  nghttp2_data data;
  nghttp2_headers headers;
  nghttp2_priority priority;
  nghttp2_rst_stream rst_stream;
  nghttp2_settings settings;
  nghttp2_push_promise push_promise;
  nghttp2_ping ping;
  nghttp2_goaway goaway;
  nghttp2_window_update window_update;
  nghttp2_extension ext;
} nghttp2_frame;

typedef int (*nghttp2_on_frame_recv_callback)(nghttp2_session *session, const nghttp2_frame *frame, void *user_data);
typedef int (*nghttp2_on_invalid_frame_recv_callback)(
    nghttp2_session *session, const nghttp2_frame *frame, int lib_error_code, void *user_data);
typedef int (*nghttp2_on_data_chunk_recv_callback)(
    nghttp2_session *session, uint8_t flags, int32_t stream_id, const char *data, size_t len, void *user_data);
typedef int (*nghttp2_on_stream_close_callback)(
    nghttp2_session *session, int32_t stream_id, uint32_t error_code, void *user_data);
typedef int (*nghttp2_on_header_callback)(
    nghttp2_session *session, const nghttp2_frame *frame, const char *name, size_t namelen,
    const char *value, size_t valuelen, uint8_t flags, void *user_data);
typedef int (*nghttp2_error_callback2)(
    nghttp2_session *session, int lib_error_code, const char *msg, size_t len, void *user_data);

int nghttp2_session_callbacks_new(nghttp2_session_callbacks **callbacks_ptr);
void nghttp2_session_callbacks_del(nghttp2_session_callbacks *callbacks);
void nghttp2_session_callbacks_set_on_frame_recv_callback(
    nghttp2_session_callbacks *cbs, nghttp2_on_frame_recv_callback);
void nghttp2_session_callbacks_set_on_invalid_frame_recv_callback(
    nghttp2_session_callbacks *cbs, nghttp2_on_invalid_frame_recv_callback);
void nghttp2_session_callbacks_set_on_data_chunk_recv_callback(
    nghttp2_session_callbacks *cbs, nghttp2_on_data_chunk_recv_callback);
void nghttp2_session_callbacks_set_on_stream_close_callback(
    nghttp2_session_callbacks *cbs, nghttp2_on_stream_close_callback);
void nghttp2_session_callbacks_set_on_header_callback(nghttp2_session_callbacks *cbs, nghttp2_on_header_callback);
void nghttp2_session_callbacks_set_error_callback2(nghttp2_session_callbacks *cbs, nghttp2_error_callback2);

int nghttp2_option_new(nghttp2_option **option_ptr);
void nghttp2_option_del(nghttp2_option *option);
void nghttp2_option_set_no_auto_window_update(nghttp2_option *option, int val);
void nghttp2_option_set_no_http_messaging(nghttp2_option *option, int val);
void nghttp2_option_set_no_closed_streams(nghttp2_option *option, int val);
void nghttp2_option_set_max_send_header_block_length(nghttp2_option *option, size_t val);
void nghttp2_option_set_max_deflate_dynamic_table_size(nghttp2_option *option, size_t val);
void nghttp2_option_set_peer_max_concurrent_streams(nghttp2_option *option, uint32_t val);
void nghttp2_option_set_max_settings(nghttp2_option *option, size_t val);
void nghttp2_option_set_max_outbound_ack(nghttp2_option *option, size_t val);
void nghttp2_option_set_no_recv_client_magic(nghttp2_option *option, int val);

int nghttp2_session_client_new2(nghttp2_session **session_ptr, const nghttp2_session_callbacks *callbacks,
                                void *user_data, const nghttp2_option *option);
int nghttp2_session_server_new2(nghttp2_session **session_ptr, const nghttp2_session_callbacks *callbacks,
                                void *user_data, const nghttp2_option *option);
void nghttp2_session_del(nghttp2_session *session);
ssize_t nghttp2_session_mem_recv(nghttp2_session *session, const char *in, size_t inlen);
ssize_t nghttp2_session_mem_send(nghttp2_session *session, const uint8_t **data_ptr);
int nghttp2_session_want_read(nghttp2_session *session);
int nghttp2_session_want_write(nghttp2_session *session);

int nghttp2_submit_settings(nghttp2_session *session, uint8_t flags, const nghttp2_settings_entry *iv, size_t niv);
int32_t nghttp2_submit_headers(nghttp2_session *session, uint8_t flags, int32_t stream_id,
                               const nghttp2_priority_spec *pri_spec, const nghttp2_nv *nva, size_t nvlen,
                               void *stream_user_data);
int nghttp2_submit_data(nghttp2_session *session, uint8_t flags, int32_t stream_id,
                        const nghttp2_data_provider *data_prd);
int nghttp2_submit_trailer(nghttp2_session *session, int32_t stream_id, const nghttp2_nv *nva, size_t nvlen);
int nghttp2_submit_rst_stream(nghttp2_session *session, uint8_t flags, int32_t stream_id, uint32_t error_code);
int nghttp2_submit_window_update(nghttp2_session *session, uint8_t flags, int32_t stream_id,
                                 int32_t window_size_increment);
int nghttp2_session_terminate_session2(nghttp2_session *session, int32_t last_stream_id, uint32_t error_code);
int nghttp2_session_consume(nghttp2_session *session, int32_t stream_id, size_t size);
int nghttp2_session_resume_data(nghttp2_session *session, int32_t stream_id);

int32_t nghttp2_session_get_stream_remote_window_size(nghttp2_session *session, int32_t stream_id);
int32_t nghttp2_session_get_remote_window_size(nghttp2_session *session);
uint32_t nghttp2_session_get_remote_settings(nghttp2_session *session, int id);
uint32_t nghttp2_session_get_local_settings(nghttp2_session *session, int id);
int32_t nghttp2_session_get_last_proc_stream_id(nghttp2_session *session);
uint32_t nghttp2_session_get_next_stream_id(nghttp2_session *session);
int32_t nghttp2_session_get_local_window_size(nghttp2_session *session);
int32_t nghttp2_session_get_effective_recv_data_length(nghttp2_session *session);
nghttp2_stream *nghttp2_session_find_stream(nghttp2_session *session, int32_t stream_id);
int nghttp2_stream_get_state(nghttp2_stream *stream);
int nghttp2_session_get_stream_local_close(nghttp2_session *session, int32_t stream_id);
const char *nghttp2_strerror(int lib_error_code);
"""

OPTIONAL = """
void nghttp2_option_set_max_continuations(nghttp2_option *option, size_t val);
void nghttp2_option_set_stream_reset_rate_limit(nghttp2_option *option, uint64_t burst, uint64_t rate);
"""
"""Declared, but present only in newer (or patched) builds: looked up with ``getattr`` before use."""

SONAME = "libnghttp2.so.14"


def load() -> tuple[Any, Any] | str:
    """``(ffi, lib)`` for the system's libnghttp2, or a one-line reason it cannot be used.

    ``PROXYBLOCKS_LIBNGHTTP2`` names another file to load (a build of one's own).
    """
    try:
        import cffi  # (cryptography's dependency: present wherever proxyblocks installs)
    except ImportError:  # pragma: no cover
        return "cffi is not installed"
    ffi = cffi.FFI()
    ffi.cdef(CDEF + OPTIONAL)
    names = [os.environ.get("PROXYBLOCKS_LIBNGHTTP2") or SONAME]
    found = ctypes.util.find_library("nghttp2")
    if found and found not in names:
        names.append(found)
    errors = []
    for name in names:
        try:
            return ffi, ffi.dlopen(name)
        except OSError as exc:
            errors.append(str(exc))
    return f"libnghttp2 not found ({'; '.join(errors)}): install Debian's libnghttp2-14"
