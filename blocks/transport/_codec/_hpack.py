"""Header blocks in the hyper-h2 codec: HPACK literals without Huffman coding out, decoding failures
named COMPRESSION_ERROR in."""

from __future__ import annotations

from typing import Any

import h2.errors
import h2.exceptions
import hpack


class PlainEncoder(hpack.Encoder):
    """An HPACK encoder that writes string literals without Huffman coding.

    RFC 7541 5.2 lets each literal be sent either way. Huffman saves about a
    fifth of the bytes of literal fields and costs, in pure Python, a third
    of a hop's HPACK time on both sides; between hops on a fast network the
    CPU is what counts. Indexed fields are unaffected.
    """

    def encode(self, headers: Any, huffman: bool = True) -> bytes:
        return super().encode(headers, huffman=False)


class CompressionError(h2.exceptions.ProtocolError):
    """A header block HPACK cannot decode: a connection error COMPRESSION_ERROR (RFC 9113 4.3)."""

    error_code = h2.errors.ErrorCodes.COMPRESSION_ERROR


class CheckedDecoder(hpack.Decoder):
    """hpack's decoder, whose failures h2 reports with the right error code.

    h2 turns every decoding error into a plain PROTOCOL_ERROR; RFC 9113 4.3
    asks for COMPRESSION_ERROR. An oversized list stays h2's business (it
    answers ENHANCE_YOUR_CALM: an HPACK bomb).
    """

    def decode(self, data: bytes, raw: bool = False) -> Any:
        try:
            return super().decode(data, raw)
        except hpack.OversizedHeaderListError:
            raise
        except (hpack.HPACKError, IndexError, TypeError, UnicodeDecodeError) as exc:
            raise CompressionError(f"undecodable header block: {exc}") from exc
