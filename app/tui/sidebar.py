"""The sidebar: a search field over the chats, and the chats as a list with each conversation's
branches under it (one level deep, each named by its own first words and, below a branch, its parent);
the chats of `llama-chat serve`'s clients apart, behind F6. Its width is set by key or by dragging its
edge, and kept for the next start."""

from __future__ import annotations

from dataclasses import dataclass

from rich.text import Text
from textual import events, on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message as UIMessage
from textual.widgets import Input, Label, Tree

from llama_chat.storage import Message, Session, StoreError
from llama_chat.storage.records import API_ORIGIN, unmarked_title

from ..chat.sessions import Sessions
from ..chat.titles import session_title, title_from_text

SEARCH_DELAY_S = 0.2  # wait for typing to pause before searching
PAGE = 100  # chats read at a time, newest first: more than a screen holds; more as the list nears its end
BRANCH_WORDS = 40  # a branch named by its first own message: that many characters of it at most
PARENT_WORDS = 24  # a branch's parent, named after it
MIN_WIDTH, CHAT_WIDTH = 16, 40  # the sidebar's narrowest, and the columns it always leaves the chat
WIDTH_STEP = 4  # columns a key press widens or narrows it


@dataclass(frozen=True)
class BranchPoint:
    """Where a fork left the session it came from: how many messages they share, and its first own one."""

    shared: int
    added: Message | None


def branch_points(chats: Sessions, sessions: list[Session]) -> dict[str, BranchPoint]:
    """For each fork among `sessions`: where it left the session it came from."""
    by_id = {s.id: s for s in sessions}
    paths: dict[str, list[Message]] = {}

    def path(session: Session) -> list[Message]:
        if session.id not in paths:
            paths[session.id] = chats.messages(session)
        return paths[session.id]

    points = {}
    for s in sessions:
        parent = by_id.get(s.forked_from)
        if parent is not None:
            own, theirs = path(s), path(parent)
            pairs = list(zip(own, theirs))
            shared = next((i for i, (a, b) in enumerate(pairs) if a.id != b.id), len(pairs))
            points[s.id] = BranchPoint(shared, own[shared] if shared < len(own) else None)
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


def own_words(session: Session, parent: Session, point: BranchPoint | None) -> str | None:
    """What tells a branch from the session it came from: its own title (given by the user, or by its
    first message), else the first words of its first own message (regenerated replies differ there);
    None while it has none."""
    if unmarked_title(session.title) != unmarked_title(parent.title):
        return session_title(session.title)
    if point is not None and point.added is not None:
        return title_from_text(point.added.content, BRANCH_WORDS)
    return None


def branch_label(session: Session, by_id: dict[str, Session], points: dict[str, BranchPoint]) -> Text:
    """A session's line: a conversation by its title; a branch by its own first words (or, while it
    has none, by its mark and where it left: "(fork) · after msg 4"), and by the branch it came from
    when that is not the conversation it is listed under, so that no two lines look the same."""
    parent = by_id.get(session.forked_from)
    if parent is None:
        return Text(session_title(session.title))  # (titles stored before they were tidied)
    point = points.get(session.id)
    words = own_words(session, parent, point)
    if words is not None:
        label = Text(words)
    else:
        label = Text(session.title[len(unmarked_title(session.title)) :].strip() or "(fork)")
        shared = point.shared if point else 0
        label.append(f" · after msg {shared}" if shared else " · from the start", style="dim")
    grandparent = by_id.get(parent.forked_from)
    if grandparent is not None:  # a branch of a branch: listed flat, its parent named
        named = own_words(parent, grandparent, points.get(parent.id)) or parent.title
        label.append(f" · from “{title_from_text(named, PARENT_WORDS)}”", style="dim")
    return label


def with_parents(chats: Sessions, sessions: list[Session]) -> list[Session]:
    """`sessions` and the sessions their branches came from, newest first: a page of the newest chats
    holds a branch replied to today whose conversation is older (a branch goes under its conversation)."""
    by_id = {s.id: s for s in sessions}
    for session in sessions:
        while session.forked_from and session.forked_from not in by_id:
            try:
                session = chats.get(session.forked_from)
            except StoreError:  # deleted meanwhile
                break
            by_id[session.id] = session
    return sorted(by_id.values(), key=lambda s: (s.updated, s.created), reverse=True)


def conversations(sessions: list[Session]) -> list[tuple[Session, list[Session]]]:
    """The sessions as conversations, in the order given (newest first), each with the branches made
    from it or from its branches, in the order they were made."""
    by_id = {s.id: s for s in sessions}

    def root(session: Session) -> Session:
        seen = {session.id}
        while session.forked_from in by_id and session.forked_from not in seen:
            session = by_id[session.forked_from]
            seen.add(session.id)
        return session

    branches: dict[str, list[Session]] = {}
    for s in sessions:
        top = root(s)
        if top.id != s.id:
            branches.setdefault(top.id, []).append(s)
    return [
        (s, sorted(branches.get(s.id, []), key=lambda b: b.created)) for s in sessions if root(s).id == s.id
    ]


class SessionTree(Tree[ChatRef]):
    """The conversations, newest first, each with its branches under it, one level deep; in search
    results, the matching messages under their session."""

    BINDINGS = [Binding("delete,d", "delete", "Delete", id="delete_session")]

    class Delete(UIMessage):
        def __init__(self, session_id: str):
            super().__init__()
            self.session_id = session_id

    class NearEnd(UIMessage):
        """The list was scrolled, or its cursor moved, to within a screen of its end."""

    def __init__(self, **kwargs):
        super().__init__("chats", **kwargs)
        self.show_root = False
        self.guide_depth = 2

    def show_sessions(
        self,
        sessions: list[Session],
        current: str | None,
        points: dict[str, BranchPoint],
        hits: dict[str, list[SearchHit]] | None = None,
        keep: bool = False,
    ) -> None:
        """Draw the sessions, each conversation with its branches under it; `points`: where each fork
        left the session it came from; `hits`: search results to list under their session (None: not
        a search); `keep`: the cursor and the scroll where they were (more of the same list)."""
        by_id = {s.id: s for s in sessions}
        # the cursor goes to the line it was on (more of the same list), else to the open chat
        kept = self.cursor_node.data if keep and self.cursor_node is not None else None
        cursor_at, scrolled = kept or ChatRef(current or ""), self.scroll_y
        self.clear()
        cursor_node = None

        def add(parent, session: Session, branches: list[Session] = ()) -> None:
            nonlocal cursor_node
            label = branch_label(session, by_id, points)
            if session.id == current:
                label = Text("● ", style="bold") + label
                label.stylize("bold")
            session_hits = (hits or {}).get(session.id, [])
            ref = ChatRef(session.id)
            node = parent.add(label, data=ref, expand=True) if branches or session_hits else None
            node = node or parent.add_leaf(label, data=ref)
            if ref == cursor_at:
                cursor_node = node
            for hit in session_hits:
                node.add_leaf(Text(hit.snippet, style="dim"), data=ChatRef(session.id, hit.message_id))
            for branch in branches:
                add(node, branch)

        for conversation, branches in conversations(sessions):
            add(self.root, conversation, branches)
        if hits is not None and not sessions:
            self.root.add_leaf(Text("nothing found", style="dim"))
        # search results from the first one, not from where the cursor was; else at the open chat
        first = self.root.children[0] if self.root.children else None
        target = first if hits is not None else cursor_node
        if target is not None:  # once drawn: a node has no line before
            self.call_after_refresh(self.move_cursor, target)
        if keep:
            self.call_after_refresh(self.scroll_to, y=scrolled, animate=False)

    def watch_scroll_y(self, old: float, new: float) -> None:
        super().watch_scroll_y(old, new)
        self.tell_near_end()

    def watch_cursor_line(self, previous_line: int, line: int) -> None:
        super().watch_cursor_line(previous_line, line)
        self.tell_near_end()

    def tell_near_end(self) -> None:
        height = self.size.height
        if self.last_line >= 0 and (
            self.max_scroll_y - self.scroll_y <= height or self.cursor_line >= self.last_line - height
        ):
            self.post_message(self.NearEnd())

    def action_delete(self) -> None:
        node = self.cursor_node
        if node is not None and node.data:
            self.post_message(self.Delete(node.data.session_id))


class Sidebar(Vertical):
    """The search field and the tree; it reads the chats (`sessions`) off the UI thread and redraws
    itself. `width`: as the user left it last time (None: the stylesheet's)."""

    BINDINGS = [Binding("down", "to_results", "Results", id="search_results", show=False)]

    class Resized(UIMessage):
        """The user gave the sidebar a new width (kept for the next start)."""

        def __init__(self, width: int):
            super().__init__()
            self.width = width

    def __init__(self, sessions: Sessions, width: int | None = None, **kwargs):
        super().__init__(**kwargs)
        self.sessions = sessions
        self.current: str | None = None  # the open chat's session, marked with "●"
        self.api_chats = False  # the chats clients of `llama-chat serve` made, instead of the user's own
        self._search_timer = None
        self._wanted = PAGE  # the newest chats the list holds: a page more each time it nears its end
        self._more = False  # whether there are more than it holds
        self._dragging, self._dragged_to = False, 0  # dragging its edge; to what width
        if width is not None:
            self.styles.width = width

    @property
    def search(self) -> Input:
        return self.query_one("#search", Input)

    def compose(self) -> ComposeResult:
        yield Label("API chats (F6: yours)", id="chats-kind")
        yield Input(placeholder="Search chats (Ctrl+F)", id="search")
        yield SessionTree(id="sessions")

    # -- which chats -------------------------------------------------------------------------------

    def show_api_chats(self, api: bool) -> None:
        """List the chats of serve's clients (else the user's own), from the next redraw."""
        self.api_chats = api
        self.query_one("#chats-kind").display = api

    # -- its width -------------------------------------------------------------------------------

    def widen(self, columns: int) -> None:
        """Wider (or, negative, narrower) by key."""
        self.post_message(self.Resized(self.set_width(self.outer_size.width + columns)))

    def set_width(self, width: int) -> int:
        """As wide as asked, within MIN_WIDTH and what leaves the chat CHAT_WIDTH columns: the width set."""
        widest = max(MIN_WIDTH, self.screen.size.width - CHAT_WIDTH)
        self.styles.width = width = min(max(width, MIN_WIDTH), widest)
        return width

    def on_mouse_down(self, event: events.MouseDown) -> None:
        """A press on the right edge starts dragging it."""
        if event.screen_x == self.region.right - 1:
            self._dragging, self._dragged_to = True, self.region.width
            self.capture_mouse()
            event.stop()

    def on_mouse_move(self, event: events.MouseMove) -> None:
        if self._dragging:
            self._dragged_to = self.set_width(event.screen_x - self.region.x + 1)

    def on_mouse_up(self, event: events.MouseUp) -> None:
        if self._dragging:
            self._dragging = False
            self.release_mouse()
            self.post_message(self.Resized(self._dragged_to))

    # -- drawing ---------------------------------------------------------------------------------

    def show_chats(self, current: str | None) -> None:
        """Redraw: every chat, or the hits of the search being typed; `current` is the open one."""
        self.current = current
        query = self.search.value.strip()
        if query:
            self.search_worker(query)
        else:
            self.sessions_worker(self._wanted)

    @on(SessionTree.NearEnd)
    def more_chats(self) -> None:
        """The next page of chats, as the list nears its end."""
        if self._more and not self.search.value.strip():
            self._more = False  # asked for once
            self._wanted += PAGE
            self.sessions_worker(self._wanted, keep=True)

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

    def listed(self, limit: int, titled: str = "") -> list[Session]:
        """The newest `limit` chats of the kind the list shows (on a worker thread): the user's own, or
        serve's clients' (F6); `titled`: those whose title holds each of its words."""
        api = {"origin": API_ORIGIN, "other_origins": not self.api_chats}
        return self.sessions.list(limit=limit, titled=titled, **api)

    @work(thread=True, exit_on_error=False, group="sidebar", exclusive=True)
    def sessions_worker(self, wanted: int, keep: bool = False) -> None:
        """The newest `wanted` chats, drawn; `keep`: the cursor where it was (the list grew)."""
        page = self.listed(wanted)
        sessions = with_parents(self.sessions, page)
        points = branch_points(self.sessions, sessions)
        self.app.call_from_thread(self.draw, sessions, points, keep=keep, more=len(page) == wanted)

    @work(thread=True, exit_on_error=False, group="sidebar", exclusive=True)
    def search_worker(self, query: str) -> None:
        """Sessions whose title contains the words or whose messages match, with their branches; each
        matching message once, under the first session that had it."""
        try:
            found = self.sessions.search(query)
        except StoreError:
            found = []
        first: dict[int, tuple[Session, Message]] = {}  # a message forks share is one hit
        for session, message in found:
            if (session.origin == API_ORIGIN) != self.api_chats:
                continue
            if message.id not in first or session.created < first[message.id][0].created:
                first[message.id] = (session, message)
        hits: dict[str, list[SearchHit]] = {}
        for session, message in first.values():
            snippet = f"{message.role}: {' '.join(message.content.split())[:60]}"
            hits.setdefault(session.id, []).append(SearchHit(message.id, snippet))
        by_id = {s.id: s for s in self.listed(PAGE, titled=query)}  # the newest chats named so
        by_id.update({session.id: session for session, _ in first.values()})
        matching = sorted(by_id.values(), key=lambda s: (s.updated, s.created), reverse=True)
        points = branch_points(self.sessions, with_parents(self.sessions, matching))
        self.app.call_from_thread(self.draw, matching, points, hits)

    def draw(
        self,
        sessions: list[Session],
        points: dict[str, BranchPoint],
        hits: dict[str, list[SearchHit]] | None = None,
        keep: bool = False,
        more: bool = False,
    ) -> None:
        """Draw what a worker read; `more`: the list holds as many chats as it asked for (so there may
        be more)."""
        self.query_one(SessionTree).show_sessions(sessions, self.current, points, hits, keep)
        if hits is None:
            self.call_after_refresh(setattr, self, "_more", more)  # asked for once the list is laid out
