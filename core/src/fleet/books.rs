//! One node's in-flight books, and the one set of rules that changes them.
//!
//! The books count what was sent to a node and has not ended: requests and tokens in flight,
//! the part sent since the node's last report ("unreflected": that report cannot show it
//! yet), the prompt tokens of that part (KV the report does not show yet), the output the
//! requests in flight are still expected to generate (KV growth still to come), and the
//! prompt tokens of the requests whose first token has not come back yet (prefill still to do
//! there, whatever the reports say: an engine may count a request it is prefilling as running,
//! not queued, and a burst is in no report until the next tick). The choice adds them to the
//! node's last report (see `choice`). One figure is not in flight: the requests the last
//! report still shows that have ended since, so that what the report counts of this router's
//! is known (`in_report_requests`) and the rest read as other routers' work.
//!
//! The same books are kept in two places: by a balancer for itself (`NodeState`), and in the
//! shared data every VM of one Envoy writes (`share::Ledger`). Both change them only by
//! applying a `Change`, the signed deltas of a dispatch, of a stream's progress or of its end,
//! built from the request's `Ticket`; so the accounting is written once, and what a VM could
//! not write to shared data yet is a `Change` too, merged into its next write.
//!
//! Two rules are part of applying a change:
//! - **The epoch rule**: a node's report epoch grows with every report taken. A report newer
//!   than the books' epoch reflects their unreflected part, which resets (`at_epoch`); a
//!   change's unreflected part applies only to books still at the epoch it was booked at, so a
//!   release never takes away work a newer report already cleared; a release booked at an
//!   older epoch counts as ended since the report instead, until the next one.
//! - **Saturation**: every figure stays within `0..=u64::MAX` whatever the deltas (the shared
//!   books are read from memory any VM may have written): a count never wraps.

use crate::fleet::node::Ticket;

/// One node's in-flight books. Plain figures, as read from and written to shared data; they
/// change by `apply` and `at_epoch`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Books {
    /// The report epoch the unreflected part belongs to.
    pub epoch: u64,
    /// The address these books count for (`node::tenant_of`): a change booked for another
    /// tenant of a reused slot is dropped, since its node has left and its work with it.
    pub tenant: u64,
    pub inflight_requests: u64,
    pub inflight_tokens: u64,
    /// Tokens (prompt + output) dispatched since the report of `epoch`.
    pub unreflected_tokens: u64,
    /// Requests dispatched since the report of `epoch`.
    pub unreflected_requests: u64,
    /// Prompt tokens dispatched since the report of `epoch`.
    pub unreflected_prompt_tokens: u64,
    /// Output tokens the in-flight requests are still expected to generate.
    pub growth_tokens: u64,
    /// Prompt tokens (less what the node is believed to have cached) of the in-flight
    /// requests that have not received their first token: prefill not done yet.
    pub prefill_tokens: u64,
    /// Requests dispatched before the report of `epoch`, so counted by it, that have ended
    /// since: with the in-flight requests it counts, what that report shows of this router's
    /// (`in_report_requests`).
    pub ended_requests: u64,
    /// Running totals, never taken back, of the prompts whose first token came back: those
    /// estimated from text, at the filter's estimate before any scaling, and the others
    /// (token ids, or text with parts not estimated), as booked. Against the engine's own
    /// count of prompt tokens they say how the engine counts what the filter estimates
    /// (`route::prompt_scale::EngineCounts`).
    pub started_text_prompt: u64,
    pub started_other_prompt: u64,
}

/// `v` moved by `d`, saturating at both ends.
fn add(v: u64, d: i64) -> u64 {
    if d >= 0 {
        v.saturating_add(d.unsigned_abs())
    } else {
        v.saturating_sub(d.unsigned_abs())
    }
}

impl Books {
    /// Whether prompts counted here wait for their first token (queued or prefilling at the
    /// engine): what the node does with them is what these books cannot know, so the node is
    /// polled every tick meanwhile (see `fleet::polling`).
    pub fn prefilling(&self) -> bool {
        self.prefill_tokens > 0
    }

    /// Empty books of `tenant`.
    pub fn of(tenant: u64) -> Books {
        Books {
            tenant,
            ..Books::default()
        }
    }

    /// The epoch rule: a report newer than the books' epoch reflects their unreflected part.
    pub fn at_epoch(mut self, report_epoch: u64) -> Books {
        if report_epoch > self.epoch {
            self.epoch = report_epoch;
            self.unreflected_tokens = 0;
            self.unreflected_requests = 0;
            self.unreflected_prompt_tokens = 0;
            self.ended_requests = 0;
        }
        self
    }

    /// This router's requests the report of `epoch` counts, as far as the books can tell:
    /// those in flight that were dispatched before it, and those that have ended since. A
    /// report a second old still shows streams that ended in that second; leaving them out
    /// would read them as other routers' work (see `choice::routers_at`).
    pub fn in_report_requests(&self) -> u64 {
        self.inflight_requests
            .saturating_sub(self.unreflected_requests)
            .saturating_add(self.ended_requests)
    }

    /// The books after `c`. Its unreflected part counts only at the books' epoch; a release
    /// booked at an older epoch is of a request the books' report counts, and counts as ended
    /// since that report.
    pub fn apply(mut self, c: &Change) -> Books {
        self.inflight_requests = add(self.inflight_requests, c.requests);
        self.inflight_tokens = add(self.inflight_tokens, c.tokens);
        self.growth_tokens = add(self.growth_tokens, c.growth);
        self.prefill_tokens = add(self.prefill_tokens, c.prefill);
        self.started_text_prompt = self.started_text_prompt.saturating_add(c.started.text);
        self.started_other_prompt = self.started_other_prompt.saturating_add(c.started.other);
        if let Some(u) = &c.unreflected {
            if u.epoch == self.epoch {
                self.unreflected_requests = add(self.unreflected_requests, u.requests);
                self.unreflected_tokens = add(self.unreflected_tokens, u.tokens);
                self.unreflected_prompt_tokens =
                    add(self.unreflected_prompt_tokens, u.prompt_tokens);
            } else if u.epoch < self.epoch && u.requests < 0 {
                self.ended_requests = add(self.ended_requests, -u.requests);
            }
        }
        self
    }

    /// Both books' figures added up, saturating (the epoch and tenant of `self` stay).
    pub fn plus(self, o: &Books) -> Books {
        Books {
            inflight_requests: self.inflight_requests.saturating_add(o.inflight_requests),
            inflight_tokens: self.inflight_tokens.saturating_add(o.inflight_tokens),
            unreflected_tokens: self.unreflected_tokens.saturating_add(o.unreflected_tokens),
            unreflected_requests: self
                .unreflected_requests
                .saturating_add(o.unreflected_requests),
            unreflected_prompt_tokens: self
                .unreflected_prompt_tokens
                .saturating_add(o.unreflected_prompt_tokens),
            growth_tokens: self.growth_tokens.saturating_add(o.growth_tokens),
            prefill_tokens: self.prefill_tokens.saturating_add(o.prefill_tokens),
            ended_requests: self.ended_requests.saturating_add(o.ended_requests),
            started_text_prompt: self
                .started_text_prompt
                .saturating_add(o.started_text_prompt),
            started_other_prompt: self
                .started_other_prompt
                .saturating_add(o.started_other_prompt),
            ..self
        }
    }

    /// Nothing in flight, nothing unreflected (the epoch, the tenant, the requests ended
    /// since the report and the running totals of started prompts aside).
    pub fn is_zero(&self) -> bool {
        Books {
            epoch: 0,
            tenant: 0,
            ended_requests: 0,
            started_text_prompt: 0,
            started_other_prompt: 0,
            ..*self
        } == Books::default()
    }
}

/// The unreflected part of a change and the epoch it was booked at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unreflected {
    pub epoch: u64,
    pub requests: i64,
    pub tokens: i64,
    pub prompt_tokens: i64,
}

/// A change to one node's books, as signed deltas: changes add up, so one that could not be
/// written merges with the next.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Change {
    pub requests: i64,
    pub tokens: i64,
    pub growth: i64,
    pub prefill: i64,
    pub unreflected: Option<Unreflected>,
    /// Prompts whose first token came (the running totals of `Books`).
    pub started: Started,
}

/// The prompt tokens of requests whose first token came back, by how they were counted (see
/// `Books::started_text_prompt`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Started {
    pub text: u64,
    pub other: u64,
}

impl Started {
    /// The prompt of `t`, once.
    pub fn of(t: &Ticket) -> Started {
        match t.text_prompt {
            0 => Started {
                text: 0,
                other: t.weight.prompt_tokens,
            },
            text => Started {
                text: u64::from(text),
                other: 0,
            },
        }
    }

    fn plus(self, o: Started) -> Started {
        Started {
            text: self.text.saturating_add(o.text),
            other: self.other.saturating_add(o.other),
        }
    }
}

/// `v` as a delta, saturating at `i64::MAX`.
fn signed(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

impl Change {
    /// The request of `t` was dispatched: in flight, unreflected at the ticket's epoch, its
    /// reserved output still to come and its prompt still to prefill.
    pub fn dispatch(t: &Ticket) -> Change {
        let tokens = signed(t.work());
        Change {
            requests: 1,
            tokens,
            growth: signed(t.reserved_output),
            prefill: signed(t.prefill()),
            unreflected: Some(Unreflected {
                epoch: t.epoch,
                requests: 1,
                tokens,
                prompt_tokens: signed(t.weight.prompt_tokens),
            }),
            started: Started::default(),
        }
    }

    /// Its stream went from `before` to `after` output tokens: that much of its reserved
    /// growth has happened (and is in the node's KV use), and its prefill is done once the
    /// first token came, when its prompt counts as started. Output past the reservation grows
    /// nothing the books hold.
    pub fn progress(t: &Ticket, before: u64, after: u64) -> Change {
        let r = t.reserved_output;
        let done = after.min(r).saturating_sub(before.min(r));
        Change {
            growth: -signed(done),
            prefill: Self::prefilled(t, before, after),
            started: if before == 0 && after > 0 {
                Started::of(t)
            } else {
                Started::default()
            },
            ..Change::default()
        }
    }

    /// The prefill taken off when output goes from `before` to `after` tokens: all of it at
    /// the first token, nothing later.
    fn prefilled(t: &Ticket, before: u64, after: u64) -> i64 {
        if before == 0 && after > 0 {
            -signed(t.prefill())
        } else {
            0
        }
    }

    /// Its stream ended; `received` is the output count the last progress was booked with. A
    /// stream that ends early returns the growth it never generated.
    pub fn release(t: &Ticket, received: u64) -> Change {
        let tokens = signed(t.work());
        Change {
            requests: -1,
            tokens: -tokens,
            growth: -signed(t.reserved_output.saturating_sub(received)),
            // What progress has not returned: all of it for a stream that ended before its
            // first token (an error, a client gone), nothing for one that had it.
            prefill: -signed(t.prefill()) - Self::prefilled(t, 0, received),
            unreflected: Some(Unreflected {
                epoch: t.epoch,
                requests: -1,
                tokens: -tokens,
                prompt_tokens: -signed(t.weight.prompt_tokens),
            }),
            started: Started::default(),
        }
    }

    /// Its stream ended; the books were told of `written` output tokens (`progress` is booked
    /// in steps), and `started` says whether the engine began to answer (a first token came,
    /// or a whole answer). `release`, and the prompt counted as started if it did and no
    /// progress said so.
    pub fn ended(t: &Ticket, written: u64, started: bool) -> Change {
        let started = if written == 0 && started {
            Started::of(t)
        } else {
            Started::default()
        };
        Change {
            started,
            ..Self::release(t, written)
        }
    }

    /// Both changes, as one. Of two unreflected parts at different epochs only the newer is
    /// kept: the older could only apply to books still at its epoch, and the books have
    /// passed it by the time the newer one was booked (epochs never go back). A release in
    /// the older part is then not counted as ended: `in_report_requests` is one short until
    /// the next report, as it was before that count existed.
    pub fn merge(self, o: Change) -> Change {
        let unreflected = match (self.unreflected, o.unreflected) {
            (Some(a), Some(b)) if a.epoch == b.epoch => Some(Unreflected {
                epoch: a.epoch,
                requests: a.requests.saturating_add(b.requests),
                tokens: a.tokens.saturating_add(b.tokens),
                prompt_tokens: a.prompt_tokens.saturating_add(b.prompt_tokens),
            }),
            (Some(a), Some(b)) => Some(if a.epoch > b.epoch { a } else { b }),
            (a, b) => a.or(b),
        };
        Change {
            requests: self.requests.saturating_add(o.requests),
            tokens: self.tokens.saturating_add(o.tokens),
            growth: self.growth.saturating_add(o.growth),
            prefill: self.prefill.saturating_add(o.prefill),
            unreflected,
            started: self.started.plus(o.started),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.requests == 0
            && self.tokens == 0
            && self.growth == 0
            && self.prefill == 0
            && self.started == Started::default()
            && self.unreflected.map_or(true, |u| {
                u.requests == 0 && u.tokens == 0 && u.prompt_tokens == 0
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ingest::request::Weight;

    fn ticket(epoch: u64, p: u64, o: u64, reserved: u64) -> Ticket {
        Ticket {
            node: 0,
            tenant: 7,
            generation: 0,
            epoch,
            weight: Weight {
                prompt_tokens: p,
                output_tokens: o,
            },
            reserved_output: reserved,
            cached: 0,
            tpot_ms: None,
            stream: 0,
            text_prompt: 0,
        }
    }

    #[test]
    fn a_dispatch_progress_and_release_cancel_out() {
        let t = ticket(3, 100, 50, 80);
        let b = Books::of(7).at_epoch(3).apply(&Change::dispatch(&t));
        assert_eq!(
            (b.inflight_requests, b.inflight_tokens, b.growth_tokens),
            (1, 150, 80)
        );
        assert_eq!(
            (
                b.unreflected_requests,
                b.unreflected_tokens,
                b.unreflected_prompt_tokens
            ),
            (1, 150, 100)
        );
        let b = b.apply(&Change::progress(&t, 0, 30));
        assert_eq!(b.growth_tokens, 50);
        // Past the reservation nothing more is taken off.
        let b = b.apply(&Change::progress(&t, 30, 200));
        assert_eq!(b.growth_tokens, 0);
        let b = b.apply(&Change::release(&t, 200));
        assert!(b.is_zero(), "{b:?}");
        assert_eq!((b.epoch, b.tenant), (3, 7));
    }

    /// A prompt counts as started once, at its first token: at the progress that says so, or
    /// at its end when no progress did; by its text estimate, or as booked when it has none;
    /// never taken back, and not at all for a stream that ended before its first token.
    #[test]
    fn a_prompt_counts_as_started_once_at_its_first_token() {
        let text = Ticket {
            text_prompt: 80,
            ..ticket(3, 100, 50, 80)
        };
        let ids = ticket(3, 100, 50, 80);
        let started = |b: Books| (b.started_text_prompt, b.started_other_prompt);
        let sent = |t: &Ticket| Books::of(7).at_epoch(3).apply(&Change::dispatch(t));
        // (ticket, changes after its dispatch, started totals)
        let cases: Vec<(&Ticket, Vec<Change>, (u64, u64))> = vec![
            (&text, vec![], (0, 0)),
            (&text, vec![Change::progress(&text, 0, 16)], (80, 0)),
            (&ids, vec![Change::progress(&ids, 0, 16)], (0, 100)),
            // Later progress and the end add nothing more.
            (
                &text,
                vec![
                    Change::progress(&text, 0, 16),
                    Change::progress(&text, 16, 32),
                    Change::ended(&text, 32, true),
                ],
                (80, 0),
            ),
            // No progress was written (fewer tokens than a step, or an answer that came
            // whole): counted at the end.
            (&text, vec![Change::ended(&text, 0, true)], (80, 0)),
            // Ended before its first token: never started.
            (&text, vec![Change::ended(&text, 0, false)], (0, 0)),
            (&ids, vec![Change::release(&ids, 0)], (0, 0)),
            // Merged changes keep the count.
            (
                &ids,
                vec![Change::progress(&ids, 0, 3).merge(Change::ended(&ids, 3, true))],
                (0, 100),
            ),
        ];
        for (t, changes, want) in cases {
            let b = changes.iter().fold(sent(t), |b, c| b.apply(c));
            assert_eq!(started(b), want, "{changes:?}");
        }
        // What started stays in the totals when the request ends, and the books are empty
        // otherwise.
        let b = sent(&text)
            .apply(&Change::progress(&text, 0, 16))
            .apply(&Change::ended(&text, 16, true));
        assert!(b.is_zero(), "{b:?}");
        assert_eq!(started(b), (80, 0));
        assert_eq!(started(b.plus(&b)), (160, 0));
        assert!(!Change::progress(&text, 0, 1).is_empty());
    }

    /// A prompt is prefill to do from its dispatch to its first token, whatever the reports
    /// say; a stream that ends before its first token returns it too; cached tokens never
    /// count.
    #[test]
    fn prefill_counts_until_the_first_token() {
        let t = Ticket {
            cached: 30,
            ..ticket(3, 100, 50, 80)
        };
        let b = Books::of(7).at_epoch(3).apply(&Change::dispatch(&t));
        assert_eq!(b.prefill_tokens, 70);
        let b = b.at_epoch(4);
        assert_eq!((b.unreflected_tokens, b.prefill_tokens), (0, 70));
        let first = b.apply(&Change::progress(&t, 0, 1));
        assert_eq!(first.prefill_tokens, 0);
        assert_eq!(first.apply(&Change::progress(&t, 1, 9)).prefill_tokens, 0);
        assert!(first.apply(&Change::release(&t, 1)).is_zero());
        // Ended before any token: the release returns the prefill.
        assert!(b.apply(&Change::release(&t, 0)).is_zero());
        assert!(Change::progress(&t, 0, 0).is_empty());
    }

    #[test]
    fn the_unreflected_part_counts_only_at_its_epoch() {
        let t = ticket(3, 10, 10, 10);
        let b = Books::of(7).at_epoch(3).apply(&Change::dispatch(&t));
        // A newer report reflects the dispatch; the release takes only what is in flight.
        let b = b.at_epoch(4);
        assert_eq!(b.unreflected_tokens, 0);
        let b = b.apply(&Change::release(&t, 0));
        assert!(b.is_zero(), "{b:?}");
        // An older report changes nothing.
        assert_eq!(b.at_epoch(2).epoch, 4);
    }

    /// What the books' report counts of this router's: the requests in flight it saw, and
    /// those that ended since it was taken; a newer report starts the count again.
    #[test]
    fn requests_the_report_counts_include_those_ended_since() {
        let (a, b, c) = (
            ticket(3, 10, 10, 10),
            ticket(3, 20, 10, 10),
            ticket(4, 5, 5, 5),
        );
        let books = Books::of(7)
            .at_epoch(3)
            .apply(&Change::dispatch(&a))
            .apply(&Change::dispatch(&b));
        // Both sent since the report of epoch 3: that report shows neither.
        assert_eq!(books.in_report_requests(), 0);
        let books = books.at_epoch(4).apply(&Change::dispatch(&c));
        assert_eq!(books.in_report_requests(), 2, "a and b, not c");
        // a ends: the report of epoch 4 still shows it.
        let books = books.apply(&Change::release(&a, 0));
        assert_eq!((books.inflight_requests, books.ended_requests), (2, 1));
        assert_eq!(books.in_report_requests(), 2);
        // c ends before any report shows it: it was never in one.
        let books = books.apply(&Change::release(&c, 0));
        assert_eq!((books.ended_requests, books.in_report_requests()), (1, 2));
        // A newer report no longer shows a.
        let books = books.at_epoch(5);
        assert_eq!((books.ended_requests, books.in_report_requests()), (0, 1));
        let books = books.apply(&Change::release(&b, 0));
        assert_eq!(books.in_report_requests(), 1);
        assert!(books.at_epoch(6).is_zero(), "{books:?}");
        // Two releases of the report's requests merged into one write count as two.
        let two = Change::release(&a, 0).merge(Change::release(&b, 0));
        let books = Books::of(7)
            .at_epoch(3)
            .apply(&Change::dispatch(&a))
            .apply(&Change::dispatch(&b))
            .at_epoch(4)
            .apply(&two);
        assert_eq!((books.inflight_requests, books.ended_requests), (0, 2));
    }

    /// Figures read from shared memory may be anything: applying a change never wraps.
    #[test]
    fn figures_saturate_at_both_ends() {
        let full = Books {
            epoch: 1,
            tenant: 7,
            inflight_requests: u64::MAX,
            inflight_tokens: u64::MAX,
            unreflected_tokens: u64::MAX,
            unreflected_requests: u64::MAX,
            unreflected_prompt_tokens: u64::MAX,
            growth_tokens: u64::MAX,
            prefill_tokens: u64::MAX,
            ended_requests: u64::MAX,
            started_text_prompt: 0,
            started_other_prompt: 0,
        };
        let huge = ticket(1, u64::MAX, u64::MAX, u64::MAX);
        let b = full.apply(&Change::dispatch(&huge));
        assert_eq!(b, full);
        assert_eq!(full.plus(&full), full);
        let empty = Books::of(7).at_epoch(1).apply(&Change::release(&huge, 0));
        assert!(empty.is_zero());
        let merged = Change::dispatch(&huge).merge(Change::dispatch(&huge));
        assert_eq!(merged.tokens, i64::MAX);
    }
}
