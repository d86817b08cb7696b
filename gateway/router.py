"""Task router for `model: "auto"`: classify a chat request by task, then pick a deployed model.

No LLM call: a long prompt is long-context by its token estimate; otherwise weighted keyword and
syntax rules score each task over the last user turn (and, at half weight, the system prompt).
Policy: long-context -> a model whose max_model_len fits; code, math, reasoning -> large;
chat, classification, extraction, summarization -> small; fall back to whatever is deployed.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

TASKS = (
    "chat",
    "classification",
    "extraction",
    "summarization",
    "code",
    "math",
    "reasoning",
    "long-context",
)
LARGE_TASKS = frozenset({"code", "math", "reasoning"})
LONG_CONTEXT_TOKENS = 2000
DEFAULT_OUTPUT_RESERVE = 256
CHARS_PER_TOKEN = 4  # rough English average; the router only needs an estimate
SCAN_HEAD, SCAN_TAIL = 1200, 300  # only this much of a prompt is scanned by the rules


def _rx(pattern: str) -> re.Pattern[str]:
    # Text is lowercased once before matching: IGNORECASE makes every pattern slower.
    return re.compile(pattern)


# (pattern, weight) per task. A pattern counts once however often it matches.
RULES: dict[str, list[tuple[re.Pattern[str], float]]] = {
    "code": [
        (_rx(r"```"), 3.0),
        (_rx(r"\b(python|javascript|typescript|java|c\+\+|c#|golang|rust|sql|bash|shell script|react|node(\.js)?"
             r"|kubernetes|dockerfile|docker|html|css|regex|in go|go (http|server|program|function|routine)|pandas|numpy|git|flask|django|kotlin|swift|php|ruby)\b"), 2.0),
        (_rx(r"\b(function|class|method|compile[rd]?|debug|stack ?trace|exception|syntax|refactor|implement"
             r"|script|query|unit tests?|pytest|async|await|variable|array|loop|linked list|binary search"
             r"|algorithm|commit|repo(sitory)?|virtual environment|pip install|api endpoint|yaml|deployment)\b"), 1.5),
        (_rx(r"\b(code|coding|program(ming)?|bug|error|typeerror|valueerror|null ?pointer|segfault)\b"), 1.0),
        (_rx(r"(\bdef \w+\(|=>|console\.log|\w+\([^()]*\);|\bfor \(|\bselect\b.{1,200}?\bfrom\b|#include|\bimport \w+"
             r"|\breturn\b[^;\n]{0,120};|\w+\.\w+\(|`[^`]+`|\bint \w+|\bfn \w+|\{\s*$)"), 2.0),
    ],
    "math": [
        (_rx(r"\b(solve|equation|derivative|differentiate|integral|integrate|limit|eigen\w*|matrix|matrices"
             r"|probability|factor(ise|ize)?|simplify|prime numbers?|gcd|greatest common divisor|lcm|logarithm|log base"
             r"|square root|sqrt|fraction|area|perimeter|volume|average speed|standard deviation|variance|median"
             r"|expected value|polynomial|compound interest|irrational|theorem|how many ways|permutations?"
             r"|combinations?|percent(age)?|calculate|compute)\b"), 2.0),
        (_rx(r"(\d\s*[-+*/^×÷=]\s*\(?[\dx]|\b[a-z]\^\d|\bf\([a-z]\)|\d+!|\d+\s*%\s*of\b|\b\d*x\s*[-+=]\s*\d)"), 2.0),
        (_rx(r"\b(what is|what's|find|how many|how much)\b[^.?!]{0,80}\d"), 1.0),
        (_rx(r"\bhow many \w+ (are there )?in an? \w+"), 2.0),  # unit conversions
        (_rx(r"\b(sum of|product of|average of|total of|mean of)\b"), 1.0),
        (_rx(r"(\$\s?\d[^.?!]{0,80}\d\s?%|\d\s?%[^.?!]{0,80}\$\s?\d)"), 1.5),  # prices with percentages
    ],
    "reasoning": [
        (_rx(r"\b(step[- ]by[- ]step|think (it )?(through|carefully)|reason(ing)?|justify|logic(al)?|puzzle|riddle"
             r"|paradox|trade-?offs?|weigh|pros and cons|both (sides|positions)|argue|analy[sz]e|decision"
             r"|hypothes[ie]s|root cause|causal|implications|flaw|fallacy|dilemma|ethical|consequences"
             r"|recommendation|explain (the|your) (trick|reasoning|answer)|clever way|trace the chain|walk me through"
             r"|can we conclude|conclude|telling the truth|lying|rational|what might be going on|argue it out"
             r"|how (do|would|can) you (tell|know|determine|decide))\b"), 2.0),
        (_rx(r"\b(if all|all \w+ are|taller than|shorter than|older than|before \w+ but after|which (day|order)"
             r"|who (owns|is in)|finishing order|how (can|do|would) (you|i|he|she|we) (measure|relabel|do it|figure out))\b"), 1.5),
        (_rx(r"\b(why might|why do you think|what would happen|should (a|we|i)|decide|compare|versus|vs\.?)\b"), 1.0),
    ],
    "summarization": [
        (_rx(r"\b(summar\w*|tl;?dr|condense|recap|gist|takeaways?|in a nutshell|boil (this|it) down|sum up"
             r"|shorten|abstract|overview|executive summary|one[- ]line|key points|main points|synopsis"
             r"|make (this|it) shorter|what'?s (it|this) about|what is (it|this) about|cliff ?notes)\b"), 3.0),
        (_rx(r"\b(briefly|in (one|two|three|a few) (sentences?|bullet points?|lines?|words))\b"), 1.0),
    ],
    "classification": [
        (_rx(r"\b(classify|classification|categori[sz]e|category|categories|label|tag|sentiment|spam|toxic"
             r"|genre|intent|priority|sarcastic|sarcasm|clickbait|emotion|star rating|route this|buckets?"
             r"|hate speech|detect (whether|if)|which (department|team|queue)|sort (this|these|each) )\b"), 2.5),
        (_rx(r"\b(positive,? (or|and) negative|positive, negative|fact or (an )?opinion|formal or informal"
             r"|yes or no|one of:|one of these|which (category|genre|type|team)|what language is)\b"), 2.0),
        (_rx(r"\b(is (this|the following) [\w\s,-]{0,60}\bor\b|(determine|decide|tell me) (whether|if)"
             r"[\w\s,-]{0,60}\bor\b|determine (whether|if|the)|decide (if|whether)|is it (spam|positive|negative)"
             r"|would you classify)\b"), 1.5),
    ],
    "extraction": [
        (_rx(r"\b(extract\w*|pull (out|the|every|all)|parse|list (all|every|the)|find (and list )?(all|every)|identify"
             r"|(give me|what are) the [\w\s',]{1,40} (from|in) (this|the)|out of this"
             r"|get the|which \w+ are mentioned|mentioned|fill in)\b"), 2.5),
        (_rx(r"\b(json( object)?|fields?|schema|key-value|as a table)\b"), 1.5),
        (_rx(r"\b(email addresses|phone numbers?|names|dates|urls|hashtags|amounts|entities|acronyms)\b"), 1.0),
    ],
    "chat": [
        (_rx(r"^\s*(hi|hello|hey|good (morning|evening|afternoon)|thanks|thank you)\b"), 2.0),
        (_rx(r"\b(recommend|suggest|advice|ideas|tips|favorite|fun fact|joke|poem|story|birthday|email to"
             r"|message for|description for|plan a|trip|cook|how do i (politely|get)|what's a good|tell me)\b"), 1.0),
    ],
}
CHAT_PRIOR = 0.9  # chat wins unless another task scores above this


@dataclass(frozen=True)
class ModelSpec:
    name: str
    size: str  # "small" | "large"
    tasks: tuple[str, ...] = ()
    max_model_len: int = 2048

    @classmethod
    def from_mapping(cls, spec: Mapping[str, Any]) -> "ModelSpec":
        engine = spec.get("engine") or {}
        return cls(
            name=str(spec["name"]),
            size=str(spec.get("size", "small")),
            tasks=tuple(spec.get("tasks") or ()),
            max_model_len=int(spec.get("max_model_len") or engine.get("max_model_len") or 2048),
        )


@dataclass(frozen=True)
class Classification:
    task: str
    prompt_tokens: int
    scores: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class RouteDecision:
    model: str
    task: str
    reason: str
    prompt_tokens: int
    elapsed_ms: float

    @property
    def header(self) -> str:
        """Value for the x-tollgate-route response header."""
        return f"{self.task}; model={self.model}; {self.reason}"


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    return "" if content is None else str(content)


def estimate_tokens(messages: Sequence[Mapping[str, Any]]) -> int:
    chars = sum(len(_text(m.get("content"))) for m in messages)
    return chars // CHARS_PER_TOKEN + 4 * len(messages)


def _scan_window(text: str) -> str:
    if len(text) <= SCAN_HEAD + SCAN_TAIL:
        return text
    return text[:SCAN_HEAD] + "\n" + text[-SCAN_TAIL:]


def _score(text: str, weight: float, scores: dict[str, float]) -> None:
    window = _scan_window(text).lower()
    for task, rules in RULES.items():
        for pattern, w in rules:
            if pattern.search(window):
                scores[task] += w * weight


def classify(messages: Sequence[Mapping[str, Any]]) -> Classification:
    tokens = estimate_tokens(messages)
    if tokens >= LONG_CONTEXT_TOKENS:
        return Classification("long-context", tokens, {"long-context": float(tokens)})
    user = [m for m in messages if m.get("role") == "user"]
    system = [m for m in messages if m.get("role") == "system"]
    scores = {t: 0.0 for t in TASKS if t != "long-context"}
    scores["chat"] = CHAT_PRIOR
    if user:
        _score(_text(user[-1].get("content")), 1.0, scores)
    for m in system:
        _score(_text(m.get("content")), 0.5, scores)
    task = max(scores, key=lambda t: scores[t])  # ties go to the earlier task in TASKS
    return Classification(task, tokens, scores)


def _fits(spec: ModelSpec, needed: int) -> bool:
    return spec.max_model_len >= needed


def choose_model(
    task: str, prompt_tokens: int, specs: Iterable[ModelSpec | Mapping[str, Any]], max_tokens: int | None = None
) -> tuple[ModelSpec, str]:
    models = [s if isinstance(s, ModelSpec) else ModelSpec.from_mapping(s) for s in specs]
    if not models:
        raise ValueError("no model is deployed")
    needed = prompt_tokens + (max_tokens or DEFAULT_OUTPUT_RESERVE)
    fitting = [m for m in models if _fits(m, needed)]
    if not fitting:
        best = max(models, key=lambda m: m.max_model_len)
        return best, f"no model fits {needed} tokens; longest context"
    if task == "long-context":
        # The cheapest that fits: small before large, then the shortest context.
        best = min(fitting, key=lambda m: ("long-context" not in m.tasks, m.size != "small", m.max_model_len))
        return best, f"fits {needed} tokens"
    want = "large" if task in LARGE_TASKS else "small"
    for pick, why in (
        (lambda m: m.size == want and task in m.tasks, f"{want} model serving {task}"),
        (lambda m: m.size == want, f"{want} model"),
        (lambda m: task in m.tasks, f"no {want} model; serves {task}"),
        (lambda m: True, f"no {want} model; fallback"),
    ):
        chosen = [m for m in fitting if pick(m)]
        if chosen:
            return chosen[0], why
    raise AssertionError("unreachable")


def route(
    messages: Sequence[Mapping[str, Any]],
    specs: Iterable[ModelSpec | Mapping[str, Any]],
    max_tokens: int | None = None,
) -> RouteDecision:
    start = time.perf_counter()
    c = classify(messages)
    spec, reason = choose_model(c.task, c.prompt_tokens, specs, max_tokens)
    return RouteDecision(spec.name, c.task, reason, c.prompt_tokens, (time.perf_counter() - start) * 1000)
