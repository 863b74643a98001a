"""The sidebar: a search field over the chats, and the chats as a tree (each fork under its parent)."""

from __future__ import annotations

from dataclasses import dataclass

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message as UIMessage
from textual.widgets import Input, Tree

from llama_chat.storage import Message, Session, StoreError

from ..chat.sessions import Sessions

SEARCH_DELAY_S = 0.2  # wait for typing to pause before searching


def branch_points(chats: Sessions, sessions: list[Session]) -> dict[str, int]:
    """For each fork among `sessions`: how many messages it shares with the session it came from."""
    by_id = {s.id: s for s in sessions}
    paths: dict[str, list[int]] = {}

    def path(session: Session) -> list[int]:
        if session.id not in paths:
            paths[session.id] = [m.id for m in chats.messages(session)]
        return paths[session.id]

    points = {}
    for s in sessions:
        parent = by_id.get(s.forked_from)
        if parent is not None:
            pairs = list(zip(path(s), path(parent)))
            points[s.id] = next((i for i, (a, b) in enumerate(pairs) if a != b), len(pairs))
    return points


@dataclass(frozen=True)
class ChatRef:
    """What a sidebar line opens: a session and, on a search hit, the message that matched."""

    session_id: str
    message_id: int | None = None


@dataclass
class SearchHit:
    message_id: int
    snippet: str


def branch_label(session: Session, parent_title: str, shared: int | None) -> Text:
    """A session's line: a branch under its parent by what it adds to the title ("(fork)") and
    where it left the parent, so that the original and its forks never look the same."""
    title = session.title
    if parent_title and title.startswith(parent_title) and title != parent_title:
        title = title[len(parent_title) :].strip() or title
    label = Text(" ".join(title.split()))  # titles stored before they were tidied
    if session.origin == "api":  # a client of `llama-chat serve` made it (F6 hides them)
        label.append(" · API", style="dim italic")
    if shared is not None:
        label.append(f" · after msg {shared}" if shared else " · from the start", style="dim")
    return label


class SessionTree(Tree[ChatRef]):
    """The conversations, newest first, each fork under the session it came from; in search results,
    the matching messages under their session."""

    BINDINGS = [Binding("delete,d", "delete", "Delete", id="delete_session")]

    class Delete(UIMessage):
        def __init__(self, session_id: str):
            super().__init__()
            self.session_id = session_id

    def __init__(self, **kwargs):
        super().__init__("chats", **kwargs)
        self.show_root = False
        self.guide_depth = 2

    def show_sessions(
        self,
        sessions: list[Session],
        current: str | None,
        branch_points: dict[str, int],
        hits: dict[str, list[SearchHit]] | None = None,
    ) -> None:
        """Draw the sessions as a tree; `branch_points`: how many messages a fork shares with its
        parent; `hits`: search results to list under their session (None: not a search)."""
        ids = {s.id for s in sessions}
        children: dict[str | None, list[Session]] = {}
        for s in sessions:
            children.setdefault(s.forked_from if s.forked_from in ids else None, []).append(s)
        for parent, kids in children.items():
            if parent is not None:  # branches in the order they were made; roots stay newest first
                kids.sort(key=lambda s: s.created)
        self.clear()
        current_node = None

        def add(parent, session: Session, parent_title: str = "") -> None:
            nonlocal current_node
            label = branch_label(session, parent_title, branch_points.get(session.id))
            if session.id == current:
                label = Text("● ", style="bold") + label
                label.stylize("bold")
            kids = children.get(session.id, [])
            session_hits = (hits or {}).get(session.id, [])
            ref = ChatRef(session.id)
            node = parent.add(label, data=ref, expand=True) if kids or session_hits else None
            node = node or parent.add_leaf(label, data=ref)
            if session.id == current:
                current_node = node
            for hit in session_hits:
                node.add_leaf(Text(hit.snippet, style="dim"), data=ChatRef(session.id, hit.message_id))
            for kid in kids:
                add(node, kid, session.title)

        for root in children.get(None, []):
            add(self.root, root)
        if hits is not None and not sessions:
            self.root.add_leaf(Text("nothing found", style="dim"))
        # search results from the first one, not from where the cursor was; else at the open chat
        first = self.root.children[0] if self.root.children else None
        target = first if hits is not None else current_node
        if target is not None:  # once drawn: a node has no line before
            self.call_after_refresh(self.move_cursor, target)

    def action_delete(self) -> None:
        node = self.cursor_node
        if node is not None and node.data:
            self.post_message(self.Delete(node.data.session_id))


class Sidebar(Vertical):
    """The search field and the tree; it reads the chats (`sessions`) off the UI thread and redraws itself."""

    BINDINGS = [Binding("down", "to_results", "Results", id="search_results", show=False)]

    def __init__(self, sessions: Sessions, **kwargs):
        super().__init__(**kwargs)
        self.sessions = sessions
        self.current: str | None = None  # the open chat's session, marked with "●"
        self.hide_api = False  # the chats clients of `llama-chat serve` made are left out
        self._search_timer = None

    @property
    def search(self) -> Input:
        return self.query_one("#search", Input)

    def compose(self) -> ComposeResult:
        yield Input(placeholder="Search chats (Ctrl+F)", id="search")
        yield SessionTree(id="sessions")

    def show_chats(self, current: str | None) -> None:
        """Redraw: every chat, or the hits of the search being typed; `current` is the open one."""
        self.current = current
        query = self.search.value.strip()
        if query:
            self.search_worker(query)
        else:
            self.sessions_worker()

    def leave_search(self) -> None:
        """Esc in the search field empties it (and the whole list comes back)."""
        if self.search.has_focus and self.search.value:
            self.search.value = ""

    @on(Input.Changed, "#search")
    def search_changed(self) -> None:
        if self._search_timer is not None:
            self._search_timer.stop()
        self._search_timer = self.set_timer(SEARCH_DELAY_S, lambda: self.show_chats(self.current))

    @on(Input.Submitted, "#search")
    def search_submitted(self) -> None:
        self.query_one(SessionTree).focus()

    def action_to_results(self) -> None:
        """↓ in the search field goes down to the chats (or the results), as Tab does."""
        if self.search.has_focus:
            self.query_one(SessionTree).focus()

    def listed(self) -> list[Session]:
        """The chats the list shows (on a worker thread)."""
        sessions = self.sessions.list()
        return [s for s in sessions if s.origin != "api"] if self.hide_api else sessions

    @work(thread=True, exit_on_error=False, group="sidebar", exclusive=True)
    def sessions_worker(self) -> None:
        sessions = self.listed()
        points = branch_points(self.sessions, sessions)
        self.app.call_from_thread(self.draw, sessions, points)

    @work(thread=True, exit_on_error=False, group="sidebar", exclusive=True)
    def search_worker(self, query: str) -> None:
        """Sessions whose title contains the words or whose messages match, as a tree (forks under
        their parent); each matching message once, under the first session that had it."""
        words = query.lower().split()
        sessions = self.listed()
        try:
            found = self.sessions.search(query)
        except StoreError:
            found = []
        first: dict[int, tuple[Session, Message]] = {}  # a message forks share is one hit
        listed = {s.id for s in sessions}
        for session, message in found:
            if session.id not in listed:
                continue
            if message.id not in first or session.created < first[message.id][0].created:
                first[message.id] = (session, message)
        hits: dict[str, list[SearchHit]] = {}
        for session, message in first.values():
            snippet = f"{message.role}: {' '.join(message.content.split())[:60]}"
            hits.setdefault(session.id, []).append(SearchHit(message.id, snippet))
        matching = [s for s in sessions if s.id in hits or all(w in s.title.lower() for w in words)]
        points = branch_points(self.sessions, sessions)
        self.app.call_from_thread(self.draw, matching, points, hits)

    def draw(
        self, sessions: list[Session], points: dict[str, int], hits: dict[str, list[SearchHit]] | None = None
    ) -> None:
        self.query_one(SessionTree).show_sessions(sessions, self.current, points, hits)
