package main

import (
	"fmt"
	"os"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
)

// plotSamples draws four panels against minutes: RSS per replica;
// goroutines and database connections per replica; the outbox's backlog
// and delivery p99; the tables' and indexes' sizes and the partition
// count.
func plotSamples(path string, rows []row, replicas int) error {
	series := func(v func(row) float64) plotter.XYs {
		xy := make(plotter.XYs, len(rows))
		for i, r := range rows {
			xy[i] = plotter.XY{X: r.at.Minutes(), Y: v(r)}
		}
		return xy
	}
	panel := func(title string, lines ...any) (*plot.Plot, error) {
		p := plot.New()
		p.Title.Text = title
		p.X.Label.Text = "minute"
		p.Legend.Top = true
		return p, plotutil.AddLinePoints(p, lines...)
	}
	var rss, work []any
	for i := range replicas {
		rss = append(rss, fmt.Sprintf("replica-%d", i), series(func(r row) float64 { return r.rssMB[i] }))
		work = append(work, fmt.Sprintf("goroutines %d", i), series(func(r row) float64 { return r.goroutines[i] }),
			fmt.Sprintf("db conns %d", i), series(func(r row) float64 { return r.conns[i] }))
	}
	a, err := panel("RSS (MB)", rss...)
	if err != nil {
		return err
	}
	b, err := panel("goroutines, database connections", work...)
	if err != nil {
		return err
	}
	c, err := panel("outbox backlog (events), delivery p99 (ms)",
		"backlog", series(func(r row) float64 { return r.backlog }), "p99 ms", series(func(r row) float64 { return r.p99ms }))
	if err != nil {
		return err
	}
	d, err := panel("outbox and inbox size (MB), partitions",
		"tables MB", series(func(r row) float64 { return r.tableMB }), "indexes MB", series(func(r row) float64 { return r.indexMB }),
		"partitions", series(func(r row) float64 { return r.partitions }))
	if err != nil {
		return err
	}
	img := vgimg.New(vg.Points(900), vg.Points(600))
	dc := draw.New(img)
	tiles := draw.Tiles{Rows: 2, Cols: 2, PadX: vg.Millimeter * 4, PadY: vg.Millimeter * 4,
		PadTop: vg.Millimeter * 2, PadBottom: vg.Millimeter * 2, PadLeft: vg.Millimeter * 2, PadRight: vg.Millimeter * 2}
	plots := [][]*plot.Plot{{a, b}, {c, d}}
	canvases := plot.Align(plots, tiles, dc)
	for i := range plots {
		for j := range plots[i] {
			plots[i][j].Draw(canvases[i][j])
		}
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	defer f.Close()
	_, err = vgimg.PngCanvas{Canvas: img}.WriteTo(f)
	return err
}
