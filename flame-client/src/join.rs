//! Running a request's pieces concurrently, on the current task.
//!
//! The pieces of one volume request are polled by the request's own future rather
//! than spawned as tasks: no allocation per task, no `'static` bound, and dropping
//! the request (an NBD client vanished) drops its pieces, which withdraws their
//! pending entries. The window bounds how many pieces are in flight, so a discard
//! of a whole large volume does not create a million futures at once.

use std::future::Future;
use std::pin::Pin;
use std::task::Poll;

/// Runs `make(item)` for every item, at most `window` at a time, and returns the
/// outputs in item order — or the first error, dropping (cancelling) the rest.
pub(crate) async fn try_join_bounded<I, F, Fut, T, E>(
    items: I,
    window: usize,
    mut make: F,
) -> Result<Vec<T>, E>
where
    I: IntoIterator,
    F: FnMut(I::Item) -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    let mut items = items.into_iter().enumerate();
    let window = window.max(1);
    let mut running: Vec<(usize, Pin<Box<Fut>>)> = Vec::with_capacity(window);
    let mut done: Vec<Option<T>> = Vec::new();
    let mut exhausted = false;
    std::future::poll_fn(move |cx| {
        loop {
            while !exhausted && running.len() < window {
                match items.next() {
                    Some((i, item)) => {
                        running.push((i, Box::pin(make(item))));
                        if done.len() <= i {
                            done.resize_with(i + 1, || None);
                        }
                    }
                    None => exhausted = true,
                }
            }
            let mut progressed = false;
            let mut k = 0;
            while k < running.len() {
                match running[k].1.as_mut().poll(cx) {
                    Poll::Ready(Ok(v)) => {
                        let (i, _) = running.swap_remove(k);
                        done[i] = Some(v);
                        progressed = true;
                    }
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Pending => k += 1,
                }
            }
            if running.is_empty() && exhausted {
                let out = std::mem::take(&mut done).into_iter().flatten().collect();
                return Poll::Ready(Ok(out));
            }
            // Finished pieces freed window slots: start more before sleeping.
            if !progressed || exhausted {
                return Poll::Pending;
            }
        }
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use flame_common::reactor::{Reactor, ReactorConfig, sleep};
    use std::cell::Cell;
    use std::rc::Rc;
    use std::time::Duration;

    #[test]
    fn keeps_order_bounds_window_and_stops_at_first_error() {
        let mut r = Reactor::new(ReactorConfig::default()).unwrap();
        r.block_on(async {
            let live = Rc::new(Cell::new(0usize));
            let peak = Rc::new(Cell::new(0usize));
            let out: Result<Vec<u64>, ()> = try_join_bounded(0..20u64, 4, |i| {
                let live = live.clone();
                let peak = peak.clone();
                async move {
                    live.set(live.get() + 1);
                    peak.set(peak.get().max(live.get()));
                    // Later items finish first: outputs must still be in order.
                    sleep(Duration::from_millis(20 - i)).await;
                    live.set(live.get() - 1);
                    Ok(i * 10)
                }
            })
            .await;
            assert_eq!(out.unwrap(), (0..20).map(|i| i * 10).collect::<Vec<_>>());
            assert_eq!(peak.get(), 4);

            let started = Rc::new(Cell::new(0));
            let res: Result<Vec<()>, u32> = try_join_bounded(0..100u32, 8, |i| {
                let started = started.clone();
                async move {
                    started.set(started.get() + 1);
                    if i == 3 {
                        return Err(i);
                    }
                    sleep(Duration::from_millis(5)).await;
                    Ok(())
                }
            })
            .await;
            assert_eq!(res, Err(3));
            assert!(started.get() < 100, "error did not stop the rest");

            let empty: Result<Vec<u8>, ()> =
                try_join_bounded(std::iter::empty::<u8>(), 4, |_| async { Ok(1) }).await;
            assert!(empty.unwrap().is_empty());
        })
        .unwrap();
    }
}
