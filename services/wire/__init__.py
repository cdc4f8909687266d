"""The wire: every message that crosses Redis (`messages`) and its msgpack codec (`codec`).

Importing the package declares every message kind before the codec decodes one (`codec` never
imports `messages`: the declarations depend on the codec, not the other way round).
"""

from services.wire import messages as messages
