//! How requests end other than by finishing: aborted (`/abort_request`), past their deadline
//! (`--request-timeout`, `--queued-request-timeout`), or cancelled (the client went away).

use std::time::{Duration, Instant};

use super::{EngineFailure, SeqId, SeqUpdate, StepEngine, Worker};

impl<E: StepEngine> Worker<E> {
    /// Ends the running or waiting requests named `rid` (every request for `None`) with
    /// finish reason `abort`.
    pub(super) fn abort(&mut self, rid: Option<&str>) {
        let hit = |r: &str| rid.is_none_or(|want| want == r);
        let ids: Vec<SeqId> = self
            .running
            .iter()
            .filter(|(_, r)| hit(&r.rid))
            .map(|(id, _)| *id)
            .collect();
        let mut ended = Vec::new();
        for id in ids {
            self.engine.remove(id);
            if let Some(r) = self.release(id) {
                ended.push(r.events);
            }
        }
        let (gone, kept): (Vec<_>, Vec<_>) = self.waiting.drain(..).partition(|w| hit(&w.rid));
        self.waiting = kept.into();
        ended.extend(gone.into_iter().map(|w| w.events));
        // The counts go out before the clients hear of the abort: a client that saw its stream
        // end and then asks `/get_load` must not find its request still counted.
        self.publish_state();
        for events in ended {
            let _ = events.send(SeqUpdate::Failed(EngineFailure::Aborted));
        }
    }

    /// Ends requests past their `--request-timeout` deadline, running or still waiting, and
    /// waiting ones past `--queued-request-timeout`.
    pub(super) fn expire(&mut self) {
        if self.limits.request_timeout.is_none() && self.limits.queue_timeout.is_none() {
            return;
        }
        let now = Instant::now();
        let late = |d: &Option<Instant>| d.is_some_and(|d| now >= d);
        let millis = |d: Option<Duration>| d.map_or(0, |d| d.as_millis() as u64);
        let timed_out = EngineFailure::TimedOut {
            millis: millis(self.limits.request_timeout),
        };
        let queue_timed_out = EngineFailure::QueueTimedOut {
            millis: millis(self.limits.queue_timeout),
        };
        let ids: Vec<SeqId> = self
            .running
            .iter()
            .filter(|(_, r)| late(&r.deadline))
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            self.engine.remove(id);
            if let Some(r) = self.release(id) {
                let _ = r.events.send(SeqUpdate::Failed(timed_out.clone()));
            }
        }
        self.waiting.retain(|w| {
            let failure = if late(&w.deadline) {
                &timed_out
            } else if late(&w.queue_deadline) {
                &queue_timed_out
            } else {
                return true;
            };
            let _ = w.events.send(SeqUpdate::Failed(failure.clone()));
            false
        });
    }

    /// Removes the sequences whose client went away (their event receiver dropped).
    pub(super) fn drop_cancelled(&mut self) {
        let gone: Vec<SeqId> = self
            .running
            .iter()
            .filter(|(_, r)| r.events.is_closed())
            .map(|(id, _)| *id)
            .collect();
        for id in gone {
            self.engine.remove(id);
            self.release(id);
        }
        self.waiting.retain(|w| !w.events.is_closed());
    }
}
