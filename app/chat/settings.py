"""What a reply is made with, defined once: the sampling parameters, the longest reply, the chat
template's own switches (thinking, reasoning effort) and the app's defaults.

The command line's flags, config.toml's [sampling] table, the settings a session stores and the TUI's
settings screen are all read from REPLY_SETTINGS; a SamplingParams is built by sampling_params() alone.
`inference/` keeps defaults of its own for use as a library; the app takes its defaults from here.

A reply's sampling, each setting from the first that has it: the command line's flags, the session's
stored settings (a new chat's come from config.toml), what the model's makers recommend
(model_sampling: the GGUF's general.sampling.* keys or the catalog's table), llama.cpp's defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from llama_chat.inference import SamplingParams
from llama_chat.inference.catalog import recommended_sampling
from llama_chat.inference.kv_cache import DEFAULT_CACHE_RAM_MB

# Past this a temperature draws uniformly anyway, and a penalty removes a token; and a value past
# float32's range (3.4e38) overflows in the sampler, which works in float32.
MAX_FACTOR = 100
MAX_TOKENS = 512  # the longest reply, in tokens
N_CTX = 4096  # the context window, in tokens (a model trained on fewer gets its own)
CACHE_RAM_MB = DEFAULT_CACHE_RAM_MB  # RAM for the KV block pool: the pool's own default
DEFAULT_PARALLEL = 4  # replies decoded together; more wait in the queue (scheduler.py)
DEFAULT_QUEUE = 64  # jobs waiting beyond those; more are refused (QueueFull)
CODEC = "q8"  # KV snapshots: the smallest codec whose resumed replies match live ones (docs/kv-cache.md)


class SettingError(ValueError):
    """A setting's value that cannot be used: one line naming the setting and what it must be."""


@dataclass(frozen=True)
class Setting:
    key: str  # the SamplingParams field, the key in config.toml and in a session's stored settings
    kind: type  # int, float, or str (one of `choices`)
    default: int | float | None
    label: str  # on the settings screen
    help: str  # in --help, before the default
    low: float | None = None  # the smallest value allowed
    high: float | None = None  # the largest value allowed
    low_open: bool = False  # `low` itself is refused: more than it, not "or more"
    flag: str = ""  # on the command line; --the-key-with-dashes unless given
    choices: tuple[str, ...] = ()  # the values of a str setting

    @property
    def option(self) -> str:
        return self.flag or "--" + self.key.replace("_", "-")

    def check(self, value) -> int | float | str:
        """The value as this setting's type, or SettingError saying what it must be."""
        if self.choices:
            if value not in self.choices:
                raise SettingError(f"{self.key} must be {self.allowed}, not {value!r}")
            return value
        wrong_type = isinstance(value, bool) or not isinstance(value, self.kind | int)  # 1 is a float's 1.0
        if wrong_type:
            raise SettingError(f"{self.key} must be {self.kind_name}, not {value!r}")
        try:
            value = self.kind(value)
        except OverflowError:  # an integer too large for a float
            raise SettingError(f"{self.key} must be {self.allowed}, not {value}") from None
        # written so that NaN fails too; every float setting has a `high`, so infinities fail
        # (a sampler works in float32: a finite float64 past its range overflows there)
        too_low = self.low is not None and not (value > self.low if self.low_open else value >= self.low)
        too_high = self.high is not None and not value <= self.high
        if too_low or too_high:
            raise SettingError(f"{self.key} must be {self.allowed}, not {value}")
        return value

    def parse(self, text: str) -> int | float | str:
        """A value typed as text (a flag, a field of the settings screen)."""
        if self.choices:
            return self.check(text.strip())
        try:
            value = self.kind(text.strip())
        except ValueError:
            raise SettingError(f"{self.key} must be {self.kind_name}, not {text!r}") from None
        return self.check(value)

    @property
    def kind_name(self) -> str:
        return "an integer" if self.kind is int else "a number"

    @property
    def allowed(self) -> str:
        """The values allowed, in words ("between 0 and 1")."""
        if self.choices:
            return "one of " + ", ".join(self.choices)
        if self.high is not None and self.low_open:
            return f"more than {self.low:g} and at most {self.high:g}"
        if self.high is not None:
            return f"between {self.low:g} and {self.high:g}"
        return f"more than {self.low:g}" if self.low_open else f"{self.low:g} or more"


_PARAMS = (
    SamplingParams()
)  # inference's defaults, llama.cpp's, are the app's for a model that recommends none
LLAMA_CPP = "llama.cpp's defaults"

SAMPLING: tuple[Setting, ...] = (
    Setting(
        "temperature",
        float,
        _PARAMS.temperature,
        "temperature (0 = greedy)",
        "how freely tokens are drawn; 0 is greedy",
        low=0,
        high=MAX_FACTOR,
        flag="--temp",
    ),
    Setting("top_k", int, _PARAMS.top_k, "top-k (0 = off)", "keep the k likeliest tokens; 0 is off", low=0),
    Setting(
        "top_p",
        float,
        _PARAMS.top_p,
        "top-p (1 = off)",
        "keep the likeliest tokens up to this probability; 1 is off",
        low=0,
        high=1,
    ),
    Setting(
        "min_p",
        float,
        _PARAMS.min_p,
        "min-p (0 = off)",
        "drop tokens less likely than this times the best; 0 is off",
        low=0,
        high=1,
    ),
    Setting(
        "repeat_penalty",
        float,
        _PARAMS.repeat_penalty,
        "repeat penalty (1 = off)",
        "penalty on recent tokens; 1 is off",
        low=0,
        high=MAX_FACTOR,
        low_open=True,
    ),
    Setting(
        "seed",
        int,
        _PARAMS.seed,
        "seed (empty = random)",
        "a seed makes a reply reproducible; without one it is random",
        low=0,  # NumPy's generators take no negative seed
    ),
)
REPLY_MAX_TOKENS = Setting(
    "max_tokens", int, MAX_TOKENS, "longest reply, in tokens", "the longest reply, in tokens", low=1
)
# The chat template's own switches: a model whose template reads neither ignores them.
THINKING = Setting(
    "thinking",
    str,
    None,
    "thinking (empty = the model's)",
    "whether a thinking model thinks before it answers (Qwen3's enable_thinking, its /think and "
    "/no_think): on or off; unset, the model's way",
    choices=("on", "off"),
)
REASONING_EFFORT = Setting(
    "reasoning_effort",
    str,
    None,
    "reasoning effort (empty = medium)",
    "how long gpt-oss reasons before it answers: low, medium or high; unset, its template's (medium)",
    choices=("low", "medium", "high"),
)
TEMPLATE_SETTINGS: tuple[Setting, ...] = (THINKING, REASONING_EFFORT)
# what a session stores and the settings screen shows: the sampling, the longest reply, the switches
REPLY_SETTINGS: tuple[Setting, ...] = (*SAMPLING, REPLY_MAX_TOKENS, *TEMPLATE_SETTINGS)
SETTINGS = {s.key: s for s in REPLY_SETTINGS}


def template_variables(settings: dict) -> dict:
    """The chat template's variables that these settings set (none where they are unset)."""
    variables = {}
    if settings.get("thinking") is not None:
        variables["enable_thinking"] = settings["thinking"] == "on"
    if settings.get("reasoning_effort") is not None:
        variables["reasoning_effort"] = settings["reasoning_effort"]
    return variables


def checked(values: dict, known: tuple[Setting, ...] = REPLY_SETTINGS) -> dict:
    """`values` with every key one of `known` and every value allowed; else SettingError on the first
    that is not. None stays None (not set: the default applies)."""
    names = {s.key: s for s in known}
    for key in values:
        if key not in names:
            raise SettingError(f"unknown setting '{key}' (known: {', '.join(names)})")
    return {key: None if value is None else names[key].check(value) for key, value in values.items()}


@dataclass(frozen=True)
class SamplingDefaults:
    """What a reply samples with where nothing was set: a value for every sampling setting."""

    values: dict
    source: str  # where they come from, in words ("Qwen2.5's model card", "llama.cpp's defaults")


def sampling_defaults(recommended: dict, source: str) -> SamplingDefaults:
    """llama.cpp's defaults, overridden by what a model recommends where its values are allowed (a
    model file's bad value is left out: the default stays)."""
    values = {s.key: s.default for s in SAMPLING}
    kept = {}
    for key, value in recommended.items():
        if key in values and key != "seed":
            try:
                value = SETTINGS[key].check(value)
            except SettingError:
                continue
            kept[key] = (
                float(f"{value:.6g}") if isinstance(value, float) else value
            )  # f32 in a GGUF: 0.699999988
    return SamplingDefaults(values | kept, source if kept else LLAMA_CPP)


def model_sampling(model) -> SamplingDefaults:
    """The sampling defaults of a loaded model (an inference Model)."""
    return sampling_defaults(*recommended_sampling(model.path, model.metadata))


DEFAULT_SAMPLING = sampling_defaults({}, LLAMA_CPP)


def sampling_params(settings: dict, defaults: SamplingDefaults = DEFAULT_SAMPLING) -> SamplingParams:
    """The SamplingParams of a reply from its settings (a session's, a config's, flags): keys that are
    not sampling (max_tokens) are left out; a missing or None one takes the model's default."""
    given = {key: value for key, value in settings.items() if value is not None}
    values = defaults.values | {s.key: given[s.key] for s in SAMPLING if s.key in given}
    return SamplingParams(**{key: value for key, value in values.items() if value is not None})


def reply_sampling(
    defaults: SamplingDefaults,
    base: dict,
    settings: dict | None,
    sampling: SamplingParams | None = None,
    grammar: str | None = None,
    logprobs: int | None = None,
) -> SamplingParams:
    """A reply's sampling: `sampling` as given, else a session's settings (`base`) overridden by the
    reply's own (`settings`), the model's `defaults` where neither sets one; shaped by a `grammar`, and
    noting `logprobs` (the likeliest tokens' log-probabilities)."""
    sampling = sampling or sampling_params({**base, **(settings or {})}, defaults)
    if grammar is None and logprobs is None:
        return sampling
    return replace(sampling, grammar=grammar, logprobs=logprobs)


def max_tokens(settings: dict, default: int = MAX_TOKENS) -> int:
    """The longest reply these settings allow: their own max_tokens, else `default`."""
    return int(settings.get("max_tokens") or default)
