//! The staleness gate, in process: a training lookup of step t waits until t minus the steps
//! applied on every PS shard is within the bound; an evaluation waits until the steps it follows
//! are applied. The service tells the gate what the shards announce (`set`: the applied steps and
//! the live bound, as its watermark follows them). Each lookup's staleness goes back to its rank in
//! the answer, and the rank counts it for the job's view.

use tokio::sync::watch;

/// What the shards have announced, and the bound.
#[derive(Clone, Copy, Debug, Default)]
pub struct Watermark {
    /// Steps applied on every shard for every rank.
    pub steps: i64,
    /// None: no bound (fully asynchronous).
    pub bound: Option<i64>,
    /// No lookup passes before the bound is known.
    pub loaded: bool,
}

/// The gate's state: the watermark, and whether the job ended.
#[derive(Clone, Copy, Default)]
struct Seen {
    mark: Watermark,
    closed: bool,
}

pub struct Gate {
    seen: watch::Sender<Seen>,
}

/// The job ended while a lookup waited.
#[derive(Debug)]
pub struct Closed;

impl Gate {
    pub fn new() -> Self {
        Self { seen: watch::Sender::new(Seen::default()) }
    }

    pub fn set(&self, mark: Watermark) {
        self.seen.send_modify(|s| s.mark = mark);
    }

    /// Wait until `open` holds of the watermark; None if the job ends first.
    async fn until(&self, open: impl Fn(&Watermark) -> bool) -> Result<Watermark, Closed> {
        let mut rx = self.seen.subscribe();
        let seen = rx.wait_for(|s| s.closed || open(&s.mark)).await.map_err(|_| Closed)?;
        if seen.closed {
            return Err(Closed);
        }
        Ok(seen.mark)
    }

    /// Wait until a lookup for `step` is within the bound; its staleness then.
    pub async fn within_bound(&self, step: i64) -> Result<i64, Closed> {
        let w = self.until(|w| w.loaded && w.bound.is_none_or(|b| step - w.steps <= b)).await?;
        Ok((step - w.steps).max(0))
    }

    /// Wait until the first `steps` steps are applied on every shard.
    pub async fn applied(&self, steps: i64) -> Result<(), Closed> {
        self.until(|w| w.steps >= steps).await.map(|_| ())
    }

    /// Wake every waiting lookup with `Closed` (the job ends); the gate opens no more.
    pub fn close(&self) {
        self.seen.send_modify(|s| s.closed = true);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "current_thread")]
    async fn a_lookup_waits_for_its_bound_and_reads_its_staleness() {
        let gate = std::sync::Arc::new(Gate::new());
        let waiting = {
            let gate = gate.clone();
            tokio::spawn(async move { gate.within_bound(5).await.unwrap() })
        };
        tokio::task::yield_now().await;
        gate.set(Watermark { steps: 2, bound: Some(2), loaded: true }); // 5 - 2 > 2: still waits
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        gate.set(Watermark { steps: 3, bound: Some(2), loaded: true });
        assert_eq!(waiting.await.unwrap(), 2);
        assert_eq!(gate.within_bound(1).await.unwrap(), 0); // ahead of the lookup: no staleness
        gate.set(Watermark { steps: 0, bound: None, loaded: true });
        assert_eq!(gate.within_bound(100).await.unwrap(), 100);
    }
}
