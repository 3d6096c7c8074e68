"""The protocol's numbers and names: versions, what each version added, size limits, codes.

Both ends read these from here and nowhere else: the server refuses past a limit,
the client stays within it and names the version a request needs. Plain constants,
nothing imported (the client's import budget, slurm_fiber/client).
"""

VERSION = 5  # the newest protocol version (docs/socket-protocol.md, "Versions")
VERSIONS = (1, 2, 3, 4, 5)  # every version a request may declare
PICKLED_SINCE = 2  # call.pickled needs "v" >= this
BATCH_SINCE = 3  # clone_batch needs "v" >= this
PAGED_SINCE = 3  # list_fibers' "after" and "limit" need "v" >= this
EARLY_SINCE = 4  # clone's and clone_batch's "early" needs "v" >= this
WINDOW_SINCE = 5  # clone_batch's "window" and the "cancel" op need "v" >= this

DEFAULT_MAX_FRAME = 1 << 20  # bytes of one request frame: a 64 KiB token and arguments
MAX_REPLY = 16 << 20  # bytes of one reply frame (fiber lists, pickled results)
MAX_RESULT = MAX_REPLY - (64 << 10)  # bytes of a call's record: its exit reply holds it whole
STDIO_NAMES = ("stdin", "stdout", "stderr")  # the descriptors a clone may pass, in order
MAX_FDS = 3  # descriptors with one clone
MAX_BATCH = 64  # items in one clone_batch
MAX_BATCH_FDS = MAX_BATCH * MAX_FDS  # descriptors with one clone_batch (SCM_MAX_FD is 253)
MAX_PAGE = 5000  # fiber records in one list_fibers page
MAX_PICKLED = 96 * 1024  # characters of base64: the template's order (128 KiB) must hold it
MAX_ID_LEN = 64  # characters of a string request id
MAX_ARGV = 4096  # exec.argv entries
MAX_ARG_LEN = 128 * 1024  # characters of one argv entry (Linux MAX_ARG_STRLEN)
MAX_ENV = 256  # env entries
MAX_ENV_VALUE = 32 * 1024  # characters of one env value
MAX_TOKEN = 64 * 1024  # characters of an inline token
MAX_PATH = 4096  # characters of exec.cwd
MAX_CALL_PATH = 64  # entries of a call's import path (call.path)
MAX_CALL_PATH_TEXT = 16 * 1024  # their characters in all: the template's order holds them
MAX_GRACE = 3600.0  # seconds of stop_fiber's grace

# Error codes (``validate.ErrorCode`` is the server's enum of the same strings).
BAD_FRAME = "bad_frame"
FRAME_TOO_LARGE = "frame_too_large"
BAD_REQUEST = "bad_request"
UNKNOWN_OP = "unknown_op"
UNSUPPORTED_VERSION = "unsupported_version"
BAD_FDS = "bad_fds"
FORBIDDEN = "forbidden"
BUSY = "busy"
TIMEOUT = "timeout"
NOT_FOUND = "not_found"
CLOSED = "closed"
INTERNAL = "internal"
